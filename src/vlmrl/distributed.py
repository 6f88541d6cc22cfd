"""Several processes, one run: who writes, how evaluation is split, and how `--gpus N` relaunches.

The same config runs on 1..N GPUs of one host through `accelerate launch` (DDP, FSDP or DeepSpeed, one shipped
config file each in `vlmrl/accelerate/`); there is no home-made distribution. Training is TRL's: its trainer
shards prompts and gathers rewards. What this module adds:

- rank helpers read from the launcher's environment (`RANK`, `WORLD_SIZE`), so they answer before (and
  without) any process group, and a one-process run never imports `torch.distributed`;
- `ensure_process_group()`: the process group, through accelerate's `PartialState`, for evaluation (training
  gets its own from transformers; both end up in the same singleton);
- `launch_command()`: the exact `accelerate launch` command that `vlmrl train|eval --gpus N` re-runs itself
  through.

On a machine without CUDA, `--gpus N` starts N CPU processes (gloo): slow, but it exercises every piece of
bookkeeping (sharded records, rank-0 writes, checkpoints) the GPU run depends on, so tests can run it.
Deliberately left out: multi-node launching (accelerate's own config does it: `num_machines`,
`machine_rank`, `main_process_ip`) and anything beyond one process per GPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Any

# --strategy -> shipped accelerate config file (src/vlmrl/accelerate/)
STRATEGIES = {
    "ddp": "ddp.yaml",  # the default: a LoRA adapter is small, a full model copy per GPU is the fastest choice
    "fsdp": "fsdp.yaml",  # shards the frozen base weights too: for a base model that does not fit one GPU
    "zero2": "deepspeed_zero2.yaml",  # shards optimizer state and gradients (needs `deepspeed`)
    "zero3": "deepspeed_zero3.yaml",  # also shards the weights (needs `deepspeed`)
}


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
    return Path(str(resources.files("vlmrl.accelerate").joinpath(STRATEGIES[strategy])))


def check_launch(gpus: int, strategy: str) -> str | None:
    """Refuse a launch that cannot work, before any process starts; returns a note for the console or None."""
    import torch

    accelerate_config(strategy)  # an unknown strategy fails here
    if gpus < 2:
        raise LaunchError(f"--gpus {gpus}: a multi-process launch needs at least 2.")
    if strategy.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        raise LaunchError(
            f"--strategy {strategy} needs DeepSpeed, which is not installed: pip install deepspeed "
            "(CUDA toolkit needed to build it), or use --strategy ddp (LoRA) or fsdp."
        )
    if not torch.cuda.is_available():
        if strategy != "ddp":
            raise LaunchError(f"--strategy {strategy} needs CUDA GPUs; this machine has none (ddp runs on the CPU).")
        return f"no CUDA GPU here: starting {gpus} CPU processes (gloo) instead; slow, for checking the bookkeeping"
    if gpus > torch.cuda.device_count():
        raise LaunchError(f"--gpus {gpus}: this machine has {torch.cuda.device_count()} CUDA GPU(s).")
    return None


def launch_command(vlmrl_args: list[str], *, gpus: int, strategy: str = "ddp") -> list[str]:
    """`accelerate launch` running `python -m vlmrl.cli <vlmrl_args>` as `gpus` processes.

    The port is picked free (`--main_process_port 0`) so two runs on one host do not collide.
    """
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(accelerate_config(strategy)),
        "--num_processes", str(gpus),
        "--num_machines", "1",
        "--main_process_port", "0",
        "--module", "vlmrl.cli", *vlmrl_args,
    ]
