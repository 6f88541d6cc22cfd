"""Stage 1, environment check: what this machine can run, written to `env.json`.

Only facts are collected here (versions, devices, which optional backends import, free disk); the CLI
decides how to show them. Nothing here needs a GPU or the network.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import shutil
import sys
from pathlib import Path

from vlmrl.common.provenance import package_version, provenance, utc_now

CORE_PACKAGES = ("torch", "torchvision", "transformers", "trl", "peft", "accelerate", "datasets", "pydantic")
OPTIONAL_BACKENDS = {
    "unsloth": "unsloth",
    "bitsandbytes": "bitsandbytes",
    "vllm": "vllm",
    "flash-attn": "flash_attn",
}


def collect_environment(path_for_disk: str | Path = ".") -> dict:
    """Versions, accelerator, optional backends and free disk, as one JSON-ready dict."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: package_version(name) for name in CORE_PACKAGES},
        "cuda": _cuda_info(),
        "backends": {name: _importable(module) for name, module in OPTIONAL_BACKENDS.items()},
        "four_bit": _four_bit(),
        "disk_free_gib": round(shutil.disk_usage(_existing_parent(Path(path_for_disk))).free / 2**30, 1),
        "cpu_count": _cpu_count(),
        "provenance": provenance(started_at=utc_now()),
    }


def _importable(module: str) -> bool:
    # find_spec first: importing unsloth or vllm is slow and has side effects, and a missing one is common.
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.import_module(module)
        return True
    except Exception:  # noqa: BLE001  (a broken optional install counts as unavailable, not a crash of doctor)
        return False


def _cuda_info() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "devices": []}
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            {
                "index": index,
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}",
            }
        )
    return {"available": True, "version": torch.version.cuda, "bf16": torch.cuda.is_bf16_supported(), "devices": devices}


def _four_bit() -> dict:
    """Whether `model.load_in_4bit=true` can load here (bitsandbytes on CUDA, or its CPU backend), and why not."""

    reason = four_bit_unsupported_reason()
    return {"available": reason is None, "reason": reason}


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


BNB_CPU_MIN = (0, 48)  # the first bitsandbytes release whose CPU backend does nf4 (de)quantization


def four_bit_unsupported_reason() -> str | None:
    """Why bitsandbytes 4-bit cannot load here (None when it can): not installed, or a CPU-only machine with a
    bitsandbytes older than its CPU backend. Checked before anything is built or downloaded."""
    import importlib.util

    import torch
    from packaging.version import Version

    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install 'vlmrl[quant]')"
    if torch.cuda.is_available():
        return None
    version = importlib.metadata.version("bitsandbytes")
    if Version(version).release < BNB_CPU_MIN:
        return (f"this machine has no CUDA GPU and bitsandbytes {version} has no CPU 4-bit backend "
                f"(pip install 'bitsandbytes>={BNB_CPU_MIN[0]}.{BNB_CPU_MIN[1]}', or set model.load_in_4bit=false)")
    return None
