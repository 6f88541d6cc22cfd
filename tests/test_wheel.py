"""What a wheel ships: every data file the package reads at run time, and a `vlmrl` that works from it alone.

The fast tests read pyproject.toml's package-data: each glob matches a file in src/vlmrl, and every file in
src/vlmrl that is not Python source is matched by one (a new data file is shipped, or the test names it). The
slow test builds the wheel offline from a copy of the sources, installs it without dependencies into a fresh
venv that borrows .venv's packages (not its editable vlmrl), and runs `vlmrl doctor --config seed`, `vlmrl bench
--help` and a two-step `vlmrl run` from that install, after reading every shipped resource through the package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "vlmrl"


def _package_data() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["vlmrl"]


def _data_files() -> list[Path]:
    """Files in src/vlmrl a wheel must carry besides the Python modules (caches and build leftovers left out)."""
    return sorted(p for p in PACKAGE.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
                  and "__pycache__" not in p.parts and not any(part.endswith(".egg-info") for part in p.parts))


def test_every_package_data_glob_matches_a_file() -> None:
    empty = [glob for glob in _package_data() if not list(PACKAGE.glob(glob))]
    assert empty == [], f"package-data globs that match nothing under src/vlmrl: {empty}"


def test_every_data_file_of_the_package_is_in_package_data() -> None:
    shipped = {path for glob in _package_data() for path in PACKAGE.glob(glob)}
    assert _data_files(), "no data files found: the shapes, presets and accelerate configs live in src/vlmrl"
    missing = [str(p.relative_to(PACKAGE)) for p in _data_files() if p not in shipped]
    assert missing == [], f"not shipped in the wheel (add to [tool.setuptools.package-data]): {missing}"


# ---- the wheel itself -------------------------------------------------------------------------------------

REWARD = '''
def varied(completions, **kwargs):
    """0..2 by the completion's length: a random tiny model then gets non-zero advantages and gradients."""
    return [(len(str(c)) % 5) / 2 for c in completions]
'''

# Every runtime resource, read through the functions the package reads it with.
RESOURCES = '''
import vlmrl, sys
from vlmrl.common.distributed import STRATEGIES, accelerate_config
from vlmrl.config.schema import PRESETS, load_config
from vlmrl.preflight.memory import load_shapes, shape_names
print(vlmrl.__file__)
for p in PRESETS:
    load_config(p)
for s in STRATEGIES:
    assert accelerate_config(s).is_file(), s
assert shape_names(), "no shapes"
for name in shape_names():
    load_shapes(name)
print("resources ok:", len(PRESETS), "presets,", len(STRATEGIES), "accelerate configs,", shape_names())
'''


def _build_wheel(tmp: Path) -> Path:
    """The wheel of a clean copy of the sources (building in the checkout would leave build/ and egg-info)."""
    source = tmp / "source"
    shutil.copytree(PACKAGE, source / "src" / "vlmrl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp / "dist"), str(source)], check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp / "dist").glob("vlmrl-*.whl")
    return wheel


def _fresh_venv(tmp: Path, wheel: Path) -> Path:
    """A venv with the wheel installed and .venv's site-packages as a plain path (so its .pth files, the
    editable vlmrl's included, are not read)."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, timeout=120)
    return venv


@pytest.mark.slow  # a wheel build, a venv and a two-step run in fresh processes: ~30 s on 2 idle cores
def test_the_wheel_alone_runs_doctor_bench_and_a_tiny_run(tmp_path: Path) -> None:
    venv = _fresh_venv(tmp_path, _build_wheel(tmp_path))
    work = tmp_path / "work"  # not the checkout: nothing is found through the current folder
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLMRL_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")

    def vlmrl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "vlmrl"), *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=120, check=False)

    done = subprocess.run([str(venv / "bin" / "python"), "-c", RESOURCES], cwd=work, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    installed = Path(done.stdout.splitlines()[0])
    assert installed.is_relative_to(venv) and not installed.is_relative_to(ROOT / "src"), installed

    doctor = vlmrl("doctor", "--config", "seed")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "memory preflight" in doctor.stdout and "peak" in doctor.stdout
    bench = vlmrl("bench", "--help")  # (its --shapes files: read above through shape_names / load_shapes)
    assert bench.returncode == 0 and "qwen3_vl_8b" in bench.stdout, bench.stdout + bench.stderr

    (work / "varied.py").write_text(REWARD)
    sets = ["model.name=tiny:qwen3_vl", f"run.output_dir={work / 'runs'}", "data.num_synthetic=40",
            "data.holdout_size=6", "eval.max_new_tokens=12", "train.max_completion_length=12", "train.max_steps=2",
            "train.per_device_train_batch_size=8", "train.save_steps=1",
            f"rewards=[{{name: format, weight: 0.3}}, {{function: '{work / 'varied.py'}:varied', weight: 1.0}}]"]
    run = vlmrl("run", "demo", *[arg for s in sets for arg in ("--set", s)])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("note: train.algorithm=gspo") == 1  # the preset's note, once (was: once per trainer)
    run_dir = work / "runs" / "demo"
    for name in ("train/final/adapter_config.json", "comparison.json", "export.json", "report.html"):
        assert (run_dir / name).exists(), name
