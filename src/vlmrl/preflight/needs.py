"""What a config needs before its first stage starts: the model and the data reachable (a local path, the hub
cache, or the hub itself), and a CUDA GPU with enough memory where the model needs one.

Without this, `vlmrl run seed` on a machine without network starts the stages, retries the hub for minutes and
ends in a long traceback. Here every missing piece is found in seconds and named in one line, with the way to
supply it: `HF_HUB_OFFLINE=1` with a filled cache, `model.name=/local/folder`, `data.source=/local/file`.

The hub is asked only when the cache lacks something and the hub is not switched off (`HF_HUB_OFFLINE`), with
a short timeout. Left out: checking that a cached snapshot is complete (a partial download fails at load time,
with the library's own message) and authentication for gated repositories beyond "could not be fetched".
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from vlmrl.config.builtin_models import is_local_only
from vlmrl.config.schema import Config

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
PROBE_TIMEOUT_S = 10.0
GPU_MARGIN = 0.92  # the share of a card the memory prediction may fill (as in `memory.advice`)


class RequirementError(RuntimeError):
    """Something the config needs is missing; the message names each piece and how to supply it."""


def check_requirements(config: Config, *, gpu: bool = True, gpus: int = 1, strategy: str = "ddp") -> None:
    """Raise RequirementError naming everything `config` needs that is not here (see the module docstring);
    the memory check is per GPU of a run of `gpus` processes sharded by `strategy` (vlmrl.preflight.memory)."""
    problems = [p for p in (_model_problem(config.model.name), _data_problem(config.data.source)) if p]
    fetch_advice = (
        " Supply them: run once with network (or set HF_HUB_OFFLINE=1 with a filled hub cache), or use "
        "model.name=/local/folder and data.source=/local/file."
    )
    if gpu:
        problems += _gpu_problems(config, gpus, strategy)
    if problems:
        fetchable = any("fetched" in p for p in problems)
        raise RequirementError("cannot start: " + "; ".join(problems) + "." + (fetch_advice if fetchable else ""))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (1/ON/YES/TRUE)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _model_problem(name: str) -> str | None:

    if is_local_only(name):
        return None  # built offline
    path = Path(name).expanduser()
    if path.is_dir():
        return None
    if not HUB_ID.match(name) or name.startswith((".", "/", "~")):
        return f"model.name {name!r} is neither a folder here nor a hub id"
    if _in_hub_cache(name, "model"):
        return None
    return _probe(name, "model")


def _data_problem(source: str) -> str | None:
    if source == "synthetic" or Path(source).expanduser().exists():
        return None
    if not HUB_ID.match(source) or source.startswith((".", "/", "~")):
        return f"data.source {source!r} is neither a file or folder here nor a hub id"
    if _in_hub_cache(source, "dataset") or _in_datasets_cache(source):
        return None
    return _probe(source, "dataset")


def _in_hub_cache(repo_id: str, kind: str) -> bool:
    """A snapshot of `repo_id` in the hub cache (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / f"{kind}s--{repo_id.replace('/', '--')}" / "snapshots"
    return folder.is_dir() and any(folder.iterdir())


def _in_datasets_cache(repo_id: str) -> bool:
    """A copy prepared by `datasets` (HF_DATASETS_CACHE, else HF_HOME/datasets), which loads offline too."""
    home = os.environ.get("HF_HOME") or str(Path("~/.cache/huggingface").expanduser())
    root = Path(os.environ.get("HF_DATASETS_CACHE") or Path(home) / "datasets")
    folder = root / repo_id.replace("/", "___")
    return folder.is_dir() and any(folder.iterdir())


def _probe(repo_id: str, kind: str) -> str | None:
    """Ask the hub whether `repo_id` exists (quickly); None when it does."""
    where = "model.name" if kind == "model" else "data.source"
    if hub_offline():
        return f"{kind} {repo_id!r} ({where}) could not be fetched: it is not in the hub cache and HF_HUB_OFFLINE is set"
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    api = HfApi()
    try:
        (api.model_info if kind == "model" else api.dataset_info)(repo_id, timeout=PROBE_TIMEOUT_S)
    except RepositoryNotFoundError:
        return f"{kind} {repo_id!r} ({where}) could not be fetched: the hub has no such repository (or it is private)"
    except Exception as exc:  # noqa: BLE001  no network, DNS, proxy, TLS: all mean "not reachable from here"
        return (f"{kind} {repo_id!r} ({where}) could not be fetched: the hub is not reachable "
                f"({type(exc).__name__}) and it is not in the hub cache")
    return None


def _gpu_problems(config: Config, gpus: int = 1, strategy: str = "ddp") -> list[str]:
    """What the model needs of this machine: a bitsandbytes that loads 4-bit here (CUDA, or its CPU backend), and a
    CUDA GPU for a model whose shapes vlmrl knows (the 8B-class presets) that fits it."""
    import torch

    from vlmrl.preflight.doctor import four_bit_unsupported_reason
    from vlmrl.preflight.memory import estimate_memory, shapes_for

    name = config.model.name
    if name == "demo-policy-gpu" and not torch.cuda.is_available():
        return [(f"model {name!r} (the demo-gpu preset) is warm-started and trained on a CUDA GPU and this machine "
                "has none (model.name=demo-policy-gpu-smoke runs the same path at toy size on a CPU)")]
    shapes = None if is_local_only(name) else shapes_for(name)
    if config.model.load_in_4bit:
        reason = four_bit_unsupported_reason()  # bitsandbytes >= 0.48 also runs nf4 on the CPU
        if reason:
            return [f"model.load_in_4bit=true: {reason}"]
    if not torch.cuda.is_available():
        if shapes is not None and not Path(name).is_dir():
            return [f"model {name!r} needs a CUDA GPU and this machine has none"]
        return []
    if shapes is None:
        return []
    try:
        estimate = estimate_memory(config, shapes, prompt_tokens=384,
                                   fast_generation=config.train.rollout.fast != "never", gpus=gpus, strategy=strategy)
    except (KeyError, TypeError, ValueError):  # a config.json without the fields the arithmetic needs
        return []
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if estimate.peak_gib > GPU_MARGIN * total:
        sharing = "" if gpus == 1 else f" on each of {gpus} GPUs ({strategy})"
        hint = "; --strategy fsdp shards the weights over the GPUs" if gpus > 1 and strategy == "ddp" else ""
        return [(f"model {name!r} is predicted to need {estimate.peak_gib:.0f} GiB of GPU memory{sharing} and cuda:0 "
                 f"has {total:.0f} GiB (`vlmrl doctor --config ...` shows the prediction and what to lower{hint})")]
    return []
