"""How `vlmrl train` and `vlmrl eval` start several processes: `--gpus N` on this host, `--nodes M` hosts, each
host re-running the same command through `accelerate launch` (vlmrl.common.distributed builds the command).

Kept apart from `cli.py`, which holds the commands; also the one-GPU-per-process check of `vlmrl bench`.
Left out: starting the other hosts (each runs its own command with its own `--node-rank`) and any launcher of
our own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import subprocess
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from vlmrl.cli.errors import claimed, fail
from vlmrl.cli.help import Strategy
from vlmrl.common.distributed import (
    LAUNCHED_ENV,
    ONE_HOST,
    STRATEGIES,
    LaunchError,
    Nodes,
    check_launch,
    launch_command,
    nodes_from_options,
    world_size,
)

console = Console()  # rich finds sys.stdout when it writes: this and cli's console share the stream

GpusOpt = Annotated[int, typer.Option(
    "--gpus", min=1, help="Run as N processes, one per GPU of this host, through `accelerate launch` (on a machine "
    "without CUDA: N CPU processes); with --nodes, per host. Already under accelerate launch / torchrun: ignored.")]
StrategyOpt = Annotated[Strategy, typer.Option(
    "--strategy",
    help="With --gpus N: ddp (default, LoRA), fsdp, or DeepSpeed zero2 / zero3; a shipped accelerate config in "
    "vlmrl/config/accelerate/.")]
NodesOpt = Annotated[int, typer.Option("--nodes", min=1, help="Hosts in the run; each runs this command with "
                                       "its own --node-rank and --gpus processes (docs/multi_gpu.md).")]
NodeRankOpt = Annotated[int | None, typer.Option("--node-rank", help="With --nodes N: this host, 0..N-1 "
                                                 "(0 on the --main-address host).")]
AddressOpt = Annotated[str | None, typer.Option("--main-address", help="With --nodes N: the --node-rank 0 host's "
                                                "address, the same on every host.")]
PortOpt = Annotated[int | None, typer.Option("--main-port", help="With --nodes N: the rendezvous port on the "
                                             "--main-address host (default 29500), the same on every host.")]


def nodes(count: int, rank: int | None, address: str | None, port: int | None) -> Nodes:
    """The --nodes options checked together (vlmrl.common.distributed.Nodes); a mistake is one line and exit 2."""
    try:
        return nodes_from_options(count, rank, address, port)
    except LaunchError as exc:
        fail(str(exc), 2)


def claimed_on_host_0(run_dir: Path, nodes: Nodes) -> contextlib.AbstractContextManager:
    """The run folder's claim, taken by host 0's command alone: it holds the folder for every host's ranks. A
    second claim from host K > 0 would be refused on one machine or on a shared filesystem whose locks span
    hosts, and would guard nothing on one whose locks do not."""
    return claimed(run_dir, create=False) if nodes.rank == 0 else contextlib.nullcontext()


def relaunch_if_asked(gpus: int, strategy: str, command: list[str], nodes: Nodes = ONE_HOST) -> None:
    """With --gpus N>1 or --nodes M>1 in a single process, re-run `vlmrl <command>` as N processes on this host
    through accelerate launch and exit with its status; otherwise return and let the command run here."""
    if strategy not in STRATEGIES:
        fail(f"--strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}.", 2)
    if (gpus == 1 and nodes.count == 1) or world_size() > 1:  # one process asked for, or already launched
        if strategy != "ddp" and world_size() == 1:
            fail(f"--strategy {strategy} needs --gpus N with N > 1.", 2)
        return
    try:
        note = check_launch(gpus, strategy, nodes)
    except LaunchError as exc:
        fail(str(exc), 2)
    if note:
        console.print(f"[yellow]note:[/yellow] {escape(note)}", soft_wrap=True)  # one line, however long
    verbose = ["--verbose"] if logging.getLogger().level == logging.DEBUG else []
    argv = launch_command([*verbose, *command], gpus=gpus, strategy=strategy, nodes=nodes)
    console.print(f"launching: {shlex.join(argv)}", highlight=False, markup=False, soft_wrap=True)
    # the ranks skip the requirement check this process ran for this host (vlmrl.cli.errors.check_needs)
    raise typer.Exit(subprocess.run(argv, check=False, env={**os.environ, LAUNCHED_ENV: "1"}).returncode)


def stage_argv(command: str, source: str | None, overrides: list[str] | None, run_dir: Path | None) -> list[str]:
    """The arguments that repeat `vlmrl <command> ...` (config, overrides, run dir) in a launched process."""
    argv = [command, *([source] if source else [])]
    for item in overrides or []:
        argv += ["--set", item]
    return argv + (["--run-dir", str(run_dir)] if run_dir else [])


def one_process_only(command: str) -> None:
    if world_size() > 1:
        fail(f"vlmrl {command} runs as one process (every rank would write the same files); run it without "
             "accelerate launch / torchrun. Only train and eval take several (--gpus N).", 2)


def one_gpu_per_process(processes: int, *, saving: bool) -> None:
    """`vlmrl bench` measures one GPU per process: exit 2 on a machine without CUDA, or when one process sees
    several GPUs (unless it only saves a model, which needs no GPU of its own)."""
    import torch

    if not torch.cuda.is_available():
        fail("vlmrl bench needs a CUDA GPU (this machine has none); see benchmarks/README.md for the commands.")
    if torch.cuda.device_count() > 1 and processes == 1 and not saving:
        fail(f"{torch.cuda.device_count()} GPUs are visible to one process, and vlmrl bench measures one GPU per "
             "process: set CUDA_VISIBLE_DEVICES=0, or run it under `accelerate launch --num_processes "
             f"{torch.cuda.device_count()}` to measure them all (docs/multi_gpu.md).")
