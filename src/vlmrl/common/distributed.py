"""Several processes, one run: who writes, how evaluation is split, and how `--gpus N` relaunches.

The same config runs on 1..N GPUs of one host, or of several hosts (`--nodes`), through `accelerate launch`
(DDP, FSDP or DeepSpeed, one shipped config file each in `vlmrl/config/accelerate/`); there is no home-made
distribution. Training is TRL's: its trainer
shards prompts and gathers rewards. What this module adds:

- rank helpers read from the launcher's environment (`RANK`, `WORLD_SIZE`), so they answer before (and
  without) any process group, and a one-process run never imports `torch.distributed`;
- `ensure_process_group()`: the process group, through accelerate's `PartialState`, for evaluation (training
  gets its own from transformers; both end up in the same singleton);
- `launch_command()`: the exact `accelerate launch` command that `vlmrl train|eval --gpus N [--nodes M ...]`
  re-runs itself through (accelerate hands several hosts to torchrun's static rendezvous: `--num_machines`,
  `--machine_rank`, `--main_process_ip`, `--main_process_port`).

On a machine without CUDA, `--gpus N` starts N CPU processes (gloo): slow, but it exercises every piece of
bookkeeping (sharded records, rank-0 writes, checkpoints) the GPU run depends on, so tests can run it.
Several hosts assume one run folder on a filesystem they all see (every rank reads the same `data/`; rank 0
of host 0 writes what is written once). Deliberately left out: starting the other hosts (ssh, SLURM: each
host runs its own `vlmrl ... --node-rank K`), elastic rendezvous, and anything beyond one process per GPU.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

# --strategy -> shipped accelerate config file (src/vlmrl/config/accelerate/)
STRATEGIES = {
    "ddp": "ddp.yaml",  # the default: a LoRA adapter is small, a full model copy per GPU is the fastest choice
    "fsdp": "fsdp.yaml",  # shards the frozen base weights too: for a base model that does not fit one GPU
    "zero2": "deepspeed_zero2.yaml",  # shards optimizer state and gradients (needs `deepspeed`)
    "zero3": "deepspeed_zero3.yaml",  # also shards the weights (needs `deepspeed`)
}
# Set by `--gpus N` / `--nodes M` in the environment of the ranks it launches: the launching process on that
# host already ran the requirement check (model files, GPU), so its ranks need not repeat the hub probes.
LAUNCHED_ENV = "VLMRL_LAUNCHED"
DEFAULT_PORT = 29500  # torchrun's and accelerate's default rendezvous port


class LaunchError(RuntimeError):
    """A multi-process launch that cannot work as asked; the message says what to change."""


def world_size() -> int:
    """Processes in this run (1 when not launched by accelerate/torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    """The process that writes shared artifacts (records, summaries, data, the final adapter)."""
    return rank() == 0


def launched_strategy() -> str:
    """The `--strategy` this process was launched with, read from what `accelerate launch` sets for its ranks
    (a launch by hand included); ddp when not launched or launched without FSDP / DeepSpeed.

    >>> launched_strategy()  # one process
    'ddp'
    """
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "fsdp"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "zero3" if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3" else "zero2"
    return "ddp"


def ensure_process_group() -> Any | None:
    """accelerate's `PartialState` when launched as several processes (creating the process group and
    pinning this process to its GPU), else None. transformers' trainer reuses the same singleton."""
    if world_size() <= 1:
        return None
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def barrier() -> None:
    """Wait for every process (no-op in a one-process run)."""
    state = ensure_process_group()
    if state is not None:
        state.wait_for_everyone()


def ranks_differing(value: str) -> list[int]:
    """The ranks whose `value` (a file digest, say) differs from rank 0's; every rank gets the same answer, so
    all of them can stop alike instead of leaving the others waiting at a collective. [] in a one-process run.

    >>> ranks_differing("abc")  # one process
    []
    """
    if world_size() <= 1:
        return []
    import torch.distributed as dist

    ensure_process_group()
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, value)
    return [k for k, v in enumerate(seen) if v != seen[0]]


def file_digest(path: Path) -> str:
    """A short content hash of a file, to tell whether the hosts of a run read the same one."""
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def my_share(items: list, *, rank_: int | None = None, world: int | None = None) -> list:
    """This rank's share of `items`, dealt round-robin: whole items (evaluation batches) stay whole, so what
    each batch generates does not depend on how many processes there are.

    >>> my_share([0, 8, 16, 24, 32], rank_=1, world=2)
    [8, 24]
    """
    rank_ = rank() if rank_ is None else rank_
    world = world_size() if world is None else world
    return items[rank_::world]


def accelerate_config(strategy: str) -> Path:
    """The shipped accelerate config file for `strategy` (ddp | fsdp | zero2 | zero3)."""
    if strategy not in STRATEGIES:
        raise LaunchError(f"--strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}.")
    return Path(str(resources.files("vlmrl.config.accelerate").joinpath(STRATEGIES[strategy])))


@dataclass(frozen=True)
class Nodes:
    """Where this host sits among several (`--nodes`, `--node-rank`, `--main-address`, `--main-port`)."""

    count: int = 1
    rank: int = 0
    address: str | None = None  # host 0's address, reachable from every host
    port: int = DEFAULT_PORT


ONE_HOST = Nodes()


def nodes_from_options(count: int, rank_: int | None, address: str | None, port: int | None) -> Nodes:
    """Check the several-host options together; a `LaunchError` says which one to change.

    >>> nodes_from_options(2, 1, "10.0.0.1", None)
    Nodes(count=2, rank=1, address='10.0.0.1', port=29500)
    >>> try:
    ...     nodes_from_options(2, 2, "10.0.0.1", None)
    ... except LaunchError as exc:
    ...     print(exc)
    --node-rank 2: with --nodes 2 it must be 0..1 (0 on the host at --main-address).
    """
    if count < 1:
        raise LaunchError(f"--nodes {count}: at least 1.")
    if count == 1:
        given = [name for name, value in (("--node-rank", rank_), ("--main-address", address), ("--main-port", port))
                 if value is not None]
        if given:
            raise LaunchError(f"{', '.join(given)} need --nodes N with N > 1 (one host needs none of them).")
        return ONE_HOST
    if rank_ is None:
        raise LaunchError(f"--nodes {count} needs --node-rank K (0 on the host at --main-address, 1..{count - 1} "
                          "on the others).")
    if not 0 <= rank_ < count:
        raise LaunchError(f"--node-rank {rank_}: with --nodes {count} it must be 0..{count - 1} "
                          "(0 on the host at --main-address).")
    if not address or not address.strip() or any(c.isspace() for c in address):
        raise LaunchError(f"--nodes {count} needs --main-address HOST: the address of the --node-rank 0 host, "
                          "reachable from every host, given the same on all of them.")
    port = DEFAULT_PORT if port is None else port
    if not 1 <= port <= 65535:
        raise LaunchError(f"--main-port {port}: a TCP port, 1..65535, the same on every host.")
    return Nodes(count, rank_, address, port)


def _port_taken(port: int) -> bool:
    """Whether something on this host already listens on `port` (accelerate would stop with a traceback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def check_launch(gpus: int, strategy: str, nodes: Nodes = ONE_HOST) -> str | None:
    """Refuse a launch that cannot work, before any process starts; returns a note for the console or None."""
    import torch

    accelerate_config(strategy)  # an unknown strategy fails here
    if gpus * nodes.count < 2:
        raise LaunchError(f"--gpus {gpus}: a multi-process launch needs at least 2.")
    if nodes.count > 1 and nodes.rank == 0 and _port_taken(nodes.port):
        raise LaunchError(f"--main-port {nodes.port} is in use on this host; choose a free port, the same on every "
                          "host.")
    if strategy.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        raise LaunchError(
            f"--strategy {strategy} needs DeepSpeed, which is not installed: pip install deepspeed "
            "(CUDA toolkit needed to build it), or use --strategy ddp (LoRA) or fsdp."
        )
    if not torch.cuda.is_available():
        if strategy != "ddp":
            raise LaunchError(f"--strategy {strategy} needs CUDA GPUs; this machine has none (ddp runs on the CPU).")
        return (f"no CUDA GPU here: starting {gpus} CPU process(es) (gloo) instead; slow, for checking the "
                "bookkeeping")
    if gpus > torch.cuda.device_count():
        raise LaunchError(f"--gpus {gpus}: this machine has {torch.cuda.device_count()} CUDA GPU(s).")
    return None


def launch_command(vlmrl_args: list[str], *, gpus: int, strategy: str = "ddp", nodes: Nodes = ONE_HOST) -> list[str]:
    """`accelerate launch` running `python -m vlmrl.cli <vlmrl_args>` as `gpus` processes on this host.

    On one host the port is picked free (`--main_process_port 0`) so two runs on one host do not collide; on
    several, every host names host 0's address and port. accelerate's `--num_processes` counts the processes
    of all hosts together (it starts `num_processes // num_machines` here).
    """
    where = ["--num_machines", "1", "--main_process_port", "0"]
    if nodes.count > 1:
        where = ["--num_machines", str(nodes.count), "--machine_rank", str(nodes.rank),
                 "--main_process_ip", str(nodes.address), "--main_process_port", str(nodes.port)]
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(accelerate_config(strategy)),
        "--num_processes", str(gpus * nodes.count),
        *where,
        "--module", "vlmrl.cli", *vlmrl_args,
    ]
