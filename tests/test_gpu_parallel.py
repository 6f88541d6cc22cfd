"""benchmarks/gpu_parallel.sh: detached per-GPU queues, waited on and packed by later calls (no GPU needed: the
jobs here are shell commands), and issue 21's plan file, which must name scripts and modes that exist."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_parallel.sh"


def _run(args: list[str], state: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLMRL_PARALLEL_STATE": str(state)}
    return subprocess.run(["bash", str(SCRIPT), *args], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_queues_run_in_order_per_gpu_and_wait_packs_results(tmp_path: Path) -> None:
    plan = tmp_path / "p.plan"
    plan.write_text(
        "# a comment, then two jobs on GPU 0 (in order) and one on GPU 1\n"
        '0 first   echo "gpu=$CUDA_VISIBLE_DEVICES" > "$JOB_OUT/first.txt"; sleep 1\n'
        '0 second  cat "$JOB_OUT/../first/first.txt" > "$JOB_OUT/second.txt"; exit 3\n'
        '1 other   echo "gpu=$CUDA_VISIBLE_DEVICES" > "$JOB_OUT/other.txt"; pwd\n')
    state, out = tmp_path / "state", tmp_path / "out"
    started = _run(["start", str(plan)], state)
    assert started.returncode == 0, started.stderr
    assert "started 3 jobs" in started.stdout

    waited = _run(["wait", "30", str(out)], state)
    assert waited.returncode == 0, waited.stdout + waited.stderr  # every job ended
    rows = {line.split()[0]: line.split() for line in waited.stdout.splitlines()[1:] if line.split()[:1]
            and line.split()[0] in ("first", "second", "other")}
    assert rows["first"][1:4] == ["0", "ended", "0"]
    assert rows["second"][1:4] == ["0", "ended", "3"]  # a failing job is reported with its exit code
    assert rows["other"][1:4] == ["1", "ended", "0"]
    assert "--- second (rc 3)" in waited.stdout

    with tarfile.open(out / "parallel.tar.gz") as tar:
        files = {m.name.lstrip("./"): m for m in tar.getmembers() if m.isfile()}
        read = lambda name: tar.extractfile(files[name]).read().decode()
        # the second job on GPU 0 started after the first had written its file: one queue runs in order
        assert read("out/second/second.txt").strip() == "gpu=0"
        assert read("out/other/other.txt").strip() == "gpu=1"
        assert read("logs/other.log").strip() == str(ROOT)  # jobs run from the repository root
        assert read("rc/second").split()[0] == "3"


def test_wait_stops_at_its_limit_and_says_what_is_still_running(tmp_path: Path) -> None:
    plan = tmp_path / "p.plan"
    plan.write_text('0 slow   sleep 30; echo done > "$JOB_OUT/x"\n0 after  true\n')
    state = tmp_path / "state"
    assert _run(["start", str(plan)], state).returncode == 0
    try:
        waited = _run(["wait", "1", str(tmp_path / "out")], state)
        assert waited.returncode == 1  # not every job ended
        table = waited.stdout
        assert re.search(r"^slow\s+0\s+running", table, re.MULTILINE)
        assert re.search(r"^after\s+0\s+queued", table, re.MULTILINE)
        assert (tmp_path / "out" / "parallel.tar.gz").is_file()  # what exists so far is packed anyway
    finally:
        subprocess.run(["pkill", "-f", "sleep 30; echo done"], check=False)


@pytest.mark.parametrize("line, why", [("x job true", "not 'GPU NAME COMMAND'"), ("0 lonely", "not 'GPU NAME")])
def test_a_malformed_plan_starts_nothing(tmp_path: Path, line: str, why: str) -> None:
    plan = tmp_path / "p.plan"
    plan.write_text(f'0 fine  echo ok > "$JOB_OUT/ok"\n{line}\n')
    state = tmp_path / "state"
    result = _run(["start", str(plan)], state)
    assert result.returncode == 2
    assert why in result.stderr
    assert not (state / "jobs").exists() or (state / "jobs").read_text() == ""


def test_start_takes_only_the_named_gpus_and_refuses_a_job_twice(tmp_path: Path) -> None:
    plan = tmp_path / "p.plan"
    plan.write_text('0 a  true\n1 b  true\n2 c  true\n')
    state = tmp_path / "state"
    first = _run(["start", str(plan), "0,2"], state)
    assert "started 2 jobs" in first.stdout
    assert sorted(line.split()[0] for line in (state / "jobs").read_text().splitlines()) == ["a", "c"]
    again = _run(["start", str(plan), "0"], state)
    assert again.returncode == 2 and "job a is already known" in again.stderr
    assert _run(["start", str(plan), "1"], state).returncode == 0
    assert _run(["wait", "20", str(tmp_path / "out")], state).returncode == 0


def test_start_by_job_name_and_a_second_start_on_a_busy_gpu_waits_for_the_first(tmp_path: Path) -> None:
    plan = tmp_path / "p.plan"
    plan.write_text('0 early_a  sleep 2; echo a > "$JOB_OUT/a"\n'
                    '1 early_b  true\n'
                    '0 late_a   cat "$JOB_OUT/../early_a/a" > "$JOB_OUT/seen"\n')
    state = tmp_path / "state"
    first = _run(["start", str(plan), "early_*"], state)
    assert "started 2 jobs" in first.stdout, first.stderr
    second = _run(["start", str(plan), "late_a"], state)  # GPU 0 is still busy with early_a
    assert "started 1 jobs" in second.stdout, second.stderr
    assert _run(["wait", "30", str(tmp_path / "out")], state).returncode == 0
    # late_a ran only after early_a had written its file, although its queue was started while early_a ran
    assert (state / "out" / "late_a" / "seen").read_text().strip() == "a"
    assert not (state / "locks" / "gpu0").exists()


def test_issue21_plan_names_scripts_and_modes_that_exist() -> None:
    """Each line of the plan of record runs a committed script with a mode that script accepts."""
    plan = ROOT / "benchmarks" / "gpu_issue21.plan"
    jobs = [line.split(maxsplit=2) for line in plan.read_text().splitlines() if line.strip()
            and not line.startswith("#")]
    assert len(jobs) >= 4 and len({name for _, name, _ in jobs}) == len(jobs)
    for gpu, name, command in jobs:
        assert gpu.isdigit(), name
        words = [w for w in shlex.split(command) if "=" not in w.split("/")[0]]
        assert words[0] == "bash", command
        script = ROOT / words[1]
        assert script.is_file(), command
        mode = words[3]
        modes = re.search(r'case "\$MODE" in\n(.*?)esac', script.read_text(), re.DOTALL).group(1)
        assert re.search(rf"(^|[\s|]){mode}[|)]", modes, re.MULTILINE), f"{script.name} has no mode {mode}"


def test_every_plan_runs_committed_scripts_with_variants_and_paths_they_know() -> None:
    """Each job of each plan runs a script that is committed, and the decode variants and bench paths it names exist
    (a typo would only show on the GPU, after minutes of device time). A path may be an engine variant: the record
    script then runs the bench through benchmarks/engine_variants.py."""
    import importlib.util

    from vlmrl.bench import PATHS

    spec = importlib.util.spec_from_file_location("engine_variants", ROOT / "benchmarks" / "engine_variants.py")
    engine_variants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine_variants)
    paths = {*PATHS, *engine_variants.engine_variants()}
    assert "engine_variants.py" in (ROOT / "benchmarks" / "gpu_record_bf16.sh").read_text()

    plans = sorted((ROOT / "benchmarks").glob("*.plan"))
    assert any(p.name == "gpu_stacked.plan" for p in plans)
    variants = set(re.findall(r'^\s+"([\w+-]+)": \[', (ROOT / "benchmarks" / "decode_variants.py").read_text(),
                              re.MULTILINE))
    assert "stacked+deferred+kernel" in variants
    for plan in plans:
        for line in plan.read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            _, name, command = line.split(maxsplit=2)
            words = shlex.split(command)
            settings = dict(w.split("=", 1) for w in words if "=" in w.split("/")[0])
            if "-m" in words:  # python3 -m vlmrl.cli COMMAND OPTIONS: the options parse as the CLI takes them
                _parses_as_cli(words[words.index("-m") + 1:], f"{plan.name}: {name}")
                continue
            script = next(w for w in words if w.endswith((".py", ".sh")))
            assert (ROOT / script).is_file(), f"{plan.name}: {name} runs {script}"
            if script.endswith("decode_variants.py"):
                for variant in [*settings.get("VARIANTS", "").split(","), settings.get("PROFILE", "")]:
                    assert variant in variants | {"", "none"}, f"{plan.name}: no decode variant {variant}"
            for path in settings.get("PATHS", "").split(","):
                assert path in paths | {""}, f"{plan.name}: no bench path {path}"


def _parses_as_cli(words: list[str], where: str) -> None:
    from typer.main import get_command

    from vlmrl.cli.app import app

    assert words[0] == "vlmrl.cli", f"{where} runs python3 -m {words[0]}"
    group = get_command(app)
    command = group.commands[words[1]]
    try:
        command.make_context(words[1], list(words[2:]))
    except Exception as exc:  # noqa: BLE001  click's usage errors (typer may carry its own click)
        raise AssertionError(f"{where}: {type(exc).__name__}: {exc}") from None


def test_a_plan_line_with_an_unknown_cli_option_is_caught() -> None:
    with pytest.raises(AssertionError, match="No such option"):
        _parses_as_cli(["vlmrl.cli", "bench", "--paths", "vlmrl", "--no-such-option"], "here")
    _parses_as_cli(["vlmrl.cli", "bench", "--paths", "vlmrl", "--varied-reward", "--out", "$JOB_OUT"], "here")
