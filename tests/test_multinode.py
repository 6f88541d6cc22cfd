"""Several hosts: `vlmrl train|eval --nodes N --node-rank K --main-address HOST [--main-port P]`.

Each host runs the same command, which re-runs itself through `accelerate launch --num_machines N
--machine_rank K --main_process_ip HOST --main_process_port P` (torchrun's static rendezvous underneath).
Here two "hosts" are two such commands started side by side on this CPU machine (gloo, one process each),
sharing one run folder as hosts share a filesystem: the training is one data-parallel run of world size 2
(each step's rollouts hold both ranks' completions), whose records, summary and adapter are written once
(rank 0 of host 0) while host 1's command takes no claim on the folder. A host reading another copy of the
data is refused on every rank alike.
"""

from __future__ import annotations

import doctest
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlmrl.cli.app import app
from vlmrl.common import distributed
from vlmrl.common.io import read_json, read_jsonl
from vlmrl.config.schema import dump_config, load_config
from vlmrl.pipeline import prepare_with_budget

PER_DEVICE = 4
OVERRIDES = [
    "model.name=tiny:qwen3_vl", "data.num_synthetic=24", "data.holdout_size=4", "eval.max_new_tokens=4",
    "eval.batch_size=2", "train.max_completion_length=6", "train.max_steps=1",
    f"train.per_device_train_batch_size={PER_DEVICE}", "train.num_generations=4", "train.save_steps=1",
]  # fmt: skip
runner = CliRunner()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def prepared(tmp_path) -> tuple[Path, Path]:
    """A prepared run folder and the YAML file of its config."""
    config = load_config("demo", [f"run.output_dir={tmp_path}", *OVERRIDES])
    prepare_with_budget(config, config.run_dir)
    path = tmp_path / "quick.yaml"
    path.write_text(dump_config(config))
    return config.run_dir, path


# --- no processes launched -------------------------------------------------------------------------------------


def test_doctests_of_distributed():
    assert doctest.testmod(distributed).failed == 0


@pytest.mark.parametrize(("options", "message"), [
    ((2, None, "10.0.0.1", None), "--nodes 2 needs --node-rank K"),
    ((2, 2, "10.0.0.1", None), "--node-rank 2: with --nodes 2 it must be 0..1"),
    ((3, -1, "10.0.0.1", None), "--node-rank -1: with --nodes 3 it must be 0..2"),
    ((2, 0, None, None), "--nodes 2 needs --main-address HOST"),
    ((2, 1, "a host", None), "--nodes 2 needs --main-address HOST"),
    ((2, 0, "10.0.0.1", 70000), "--main-port 70000: a TCP port"),
    ((1, 1, None, None), "--node-rank need --nodes N with N > 1"),
    ((1, None, "10.0.0.1", 29501), "--main-address, --main-port need --nodes N"),
])  # fmt: skip
def test_inconsistent_node_options_are_refused(options, message):
    with pytest.raises(distributed.LaunchError) as caught:
        distributed.nodes_from_options(*options)
    assert str(caught.value).startswith(message), str(caught.value)


def test_launch_command_names_every_host_and_counts_all_processes():
    nodes = distributed.nodes_from_options(2, 1, "10.0.0.1", None)
    command = distributed.launch_command(["train", "c.yaml"], gpus=8, strategy="ddp", nodes=nodes)
    flags = dict(zip(command[3:-4:2], command[4:-4:2]))
    assert flags["--num_processes"] == "16"  # accelerate counts all hosts' processes, starts 16 // 2 here
    assert (flags["--num_machines"], flags["--machine_rank"]) == ("2", "1")
    assert (flags["--main_process_ip"], flags["--main_process_port"]) == ("10.0.0.1", "29500")
    assert command[-4:] == ["--module", "vlmrl.cli", "train", "c.yaml"]
    one_host = distributed.launch_command(["train"], gpus=2)
    assert "--machine_rank" not in one_host and one_host[one_host.index("--main_process_port") + 1] == "0"


def test_bad_node_options_exit_2_in_one_line_without_launching(prepared):
    _, path = prepared
    cases = [
        (["--nodes", "2", "--node-rank", "2", "--main-address", "127.0.0.1"], "must be 0..1"),
        (["--nodes", "2", "--node-rank", "0"], "needs --main-address HOST"),
        (["--node-rank", "1"], "need --nodes N with N > 1"),
        (["--nodes", "0"], "--nodes"),
    ]
    for command in ("train", "eval"):
        for args, message in cases:
            result = runner.invoke(app, [command, str(path), *args], terminal_width=200)
            assert result.exit_code == 2 and message in result.output, (command, args, result.output)
            assert "launching" not in result.output and "Traceback" not in result.output


def test_a_busy_port_on_host_0_is_refused_before_launching(prepared):
    _, path = prepared
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(app, ["train", str(path), "--nodes", "2", "--node-rank", "0", "--main-address",
                                     "127.0.0.1", "--main-port", str(port)], terminal_width=200)
    assert result.exit_code == 2 and f"--main-port {port} is in use" in result.output, result.output
    assert "launching" not in result.output


def test_ranks_started_by_a_vlmrl_launcher_skip_the_requirement_check(monkeypatch, prepared):
    from vlmrl.cli import errors as cli_errors
    from vlmrl.preflight import needs

    _, path = prepared
    config = load_config(str(path))
    calls = []
    monkeypatch.setattr(needs, "check_requirements", lambda *a, **k: calls.append(a))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv(distributed.LAUNCHED_ENV, raising=False)
    cli_errors.check_needs(config)  # a bare accelerate launch / torchrun: every rank checks
    monkeypatch.setenv(distributed.LAUNCHED_ENV, "1")
    cli_errors.check_needs(config)  # started by `--gpus N` or `--nodes M` on any host: its launcher checked
    assert len(calls) == 1


# --- two hosts as two commands ---------------------------------------------------------------------------------


def start_node(path: Path, rank_: int, port: int, run_dir: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "vlmrl.cli", "train", str(path), "--run-dir", str(run_dir), "--gpus", "1",
            "--nodes", "2", "--node-rank", str(rank_), "--main-address", "127.0.0.1", "--main-port", str(port)]
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def run_two_nodes(path: Path, run_dirs: tuple[Path, Path]) -> list[tuple[int, str]]:
    port = free_port()
    nodes = [start_node(path, k, port, run_dirs[k]) for k in (0, 1)]
    done = []
    for node in nodes:
        try:
            output, _ = node.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            raise
        done.append((node.returncode, output))
    return done


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_hosts_train_one_data_parallel_run_written_once(prepared):
    run_dir, path = prepared
    (code0, out0), (code1, out1) = run_two_nodes(path, (run_dir, run_dir))
    assert code0 == 0, out0[-6000:]
    assert code1 == 0, out1[-6000:]
    for k, output in enumerate((out0, out1)):
        assert "--num_processes 2 --num_machines 2" in output and f"--machine_rank {k}" in output, output[-3000:]
    train_dir = run_dir / "train"
    summary = read_json(train_dir / "summary.json")
    assert summary["world_size"] == 2 and summary["steps"] == 1
    assert ": adapter " in out0 and ": adapter " not in out1  # host 0's rank 0 reports, host 1 stays quiet
    # one data-parallel step: its generation batch holds both ranks' completions (2 x per-device), logged once
    assert Counter(r["step"] for r in read_jsonl(train_dir / "rollouts.jsonl")) == {1: 2 * PER_DEVICE}
    metrics = read_jsonl(train_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics if "train_runtime" not in r] == [1]
    checkpoint = train_dir / "checkpoints" / "checkpoint-1"
    assert {p.name for p in checkpoint.glob("rng_state_*.pth")} == {"rng_state_0.pth", "rng_state_1.pth"}
    assert len(list(checkpoint.glob("adapter_model.safetensors"))) == 1
    assert (train_dir / "final" / "adapter_model.safetensors").is_file()
    assert not any(p.name.endswith(".tmp") for p in run_dir.rglob("*"))  # no half-written duplicate


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hosts_reading_different_data_are_refused_alike(prepared, tmp_path):
    import shutil

    run_dir, path = prepared
    other = tmp_path / "host1-copy"
    shutil.copytree(run_dir, other)
    rows = (other / "data" / "train.jsonl").read_text().splitlines()
    (other / "data" / "train.jsonl").write_text("\n".join(rows[:-1]) + "\n")  # a copy that drifted
    (code0, out0), (code1, out1) = run_two_nodes(path, (run_dir, other))
    assert code0 != 0 and code1 != 0
    for output in (out0, out1):  # the same one-line refusal on both hosts, none left waiting
        assert "differs between rank 0 and rank(s) 1: every host must read the same run folder" in output, output[-3000:]
    assert not (run_dir / "train" / "summary.json").exists()
