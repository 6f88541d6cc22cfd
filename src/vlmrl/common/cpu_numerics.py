"""Less of the CPU arithmetic left to the host: the kernels' instruction set pinned before torch first computes.

PyTorch picks its CPU kernels by the host's instruction set (AVX-512 where present, else AVX2), and MKL and
oneDNN do the same; each sums in its own order, so a float32 run on an AVX-512 host and on an AVX2 host drift
apart, and a sampled RL run turns that drift into other answers. `pin_cpu_kernels()` sets, unless the user set
them, the variables that make all three use their AVX2 code on any host that has AVX2:
`ATEN_CPU_CAPABILITY=avx2`, `MKL_CBWR=AVX2,STRICT` (MKL's conditional numerical reproducibility, strict: the same
bits whatever the thread count, for its matrix products) and `ONEDNN_MAX_CPU_ISA=AVX2`. They are read when torch
first runs a CPU operation, so the call must come before any tensor work; importing `vlmrl` makes it.
Sums split across threads also depend on how many there are: `pin_cpu_threads()` sets torch's intra-op thread
count to CPU_THREADS for a run on the CPU (the model loading calls it when no CUDA device is present), so a
2-core laptop and a 64-core server split their sums alike.

`VLMRL_CPU_KERNELS=native` skips the pinning (the host's fastest kernels, results tied to the host).
Limits: this removes the instruction set and the thread count from what decides the digits, not everything.
MKL picks its code path by the CPU's vendor and model too (on an AMD EPYC, `MKL_CBWR`'s AVX2, AVX-512 and SSE4.2
branches gave the same bits for a matrix product we checked, only `COMPATIBLE` other ones),
so two machines can still print other digits (docs/learning.md); hosts without AVX2, non-x86 hosts (Arm), and
another torch, MKL or oneDNN release run other code. CUDA arithmetic is untouched.
"""

from __future__ import annotations

import os

PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}
CPU_THREADS = 2


def native() -> bool:
    return os.environ.get("VLMRL_CPU_KERNELS", "").lower() == "native"


def pin_cpu_kernels(environ: dict | None = None) -> dict[str, str]:
    """Set the pinning variables that are not set yet (none with VLMRL_CPU_KERNELS=native); returns those set."""
    env = os.environ if environ is None else environ
    if str(env.get("VLMRL_CPU_KERNELS", "")).lower() == "native":
        return {}
    chosen = {name: value for name, value in PINNED.items() if name not in env}
    env.update(chosen)
    return chosen


def pin_cpu_threads() -> None:
    """CPU_THREADS intra-op threads for torch (unless VLMRL_CPU_KERNELS=native): for runs on the CPU only."""
    import torch

    if not native() and torch.get_num_threads() != CPU_THREADS:
        torch.set_num_threads(CPU_THREADS)


def cpu_kernels() -> dict[str, str | int | None]:
    """What this process runs with: each pinning variable's value and the capability torch dispatches to."""
    import torch

    return {**{name: os.environ.get(name) for name in PINNED},
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch_threads": torch.get_num_threads()}
