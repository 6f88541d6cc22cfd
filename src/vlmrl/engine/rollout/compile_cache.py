"""torch.compile's on-disk caches, kept with vlmrl's own cache so a second run skips most of the first step's compile.

The compiled decode step costs the first training step most of its time (benchmarks/NOTES.md, "The first step:
the compile cache"). Inductor already caches its work on disk (the FX graph cache, the AOTAutograd cache,
autotuning results, and Triton's compiled kernels), but by default under `/tmp/torchinductor_<user>` and
`~/.triton/cache`: a temp folder many machines wipe at reboot and containers start without. Pointing both at
`<vlmrl cache>/compile/` (`$VLMRL_CACHE`, default `~/.cache/vlmrl`) keeps them beside the demo policy, on a disk
a user already knows to keep, before the first compile of a train, eval or bench process.

A user who set `TORCHINDUCTOR_CACHE_DIR` or `TRITON_CACHE_DIR` keeps them: this only fills in what is unset.
`vlmrl bench --compile-cache DIR` names the folder outright, so two processes can measure a cold and a warm
first step against the same folder; whether it was cold (empty) is recorded with the bench's figures.

Left out: torch's "mega-cache" (`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`), which packs the
same artifacts into one blob for copying between machines: the env-var folders serve one machine with no extra
save step. Dynamo's tracing and CUDA-graph recording are not cached by torch at all; a warm first step still pays
for those.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_ENV = "TRITON_CACHE_DIR"


@dataclass(frozen=True)
class CompileCache:
    """Where this process's compile caches live, who chose it, and whether they held anything at start."""

    inductor_dir: str
    triton_dir: str
    source: str  # "vlmrl" (our default), "user env" (the user's variables), "explicit" (--compile-cache)
    cold: bool  # the inductor folder held no file when this process started
    files_at_start: int

    def as_dict(self) -> dict:
        return asdict(self)


def default_compile_dir() -> Path:
    """`<vlmrl cache>/compile`, or `compile-native` under VLMRL_CPU_KERNELS=native: inductor's CPU kernels are
    built for the instruction set torch dispatches to, and its cache does not tell the two apart (a kernel
    built under one and loaded under the other aborted the process)."""
    from vlmrl.common.cpu_numerics import native
    from vlmrl.common.paths import cache_root

    return cache_root() / ("compile-native" if native() else "compile")


def use_compile_cache(directory: Path | None = None) -> CompileCache:
    """Point inductor's and Triton's caches at `directory` (explicit) or `<vlmrl cache>/compile` (unless the user
    set the variables). Call before the first `torch.compile` of the process; the variables are read at compile
    time (torch's `cache_dir()` reads the environment at each call)."""
    if directory is not None:
        root = Path(directory).expanduser().resolve()
        os.environ[INDUCTOR_ENV] = str(root / "inductor")
        os.environ[TRITON_ENV] = str(root / "triton")
        source = "explicit"
    else:
        root = default_compile_dir()
        user_set = [name for name in (INDUCTOR_ENV, TRITON_ENV) if os.environ.get(name)]
        os.environ.setdefault(INDUCTOR_ENV, str(root / "inductor"))
        os.environ.setdefault(TRITON_ENV, str(root / "triton"))
        source = "user env" if user_set else "vlmrl"
    inductor, triton = Path(os.environ[INDUCTOR_ENV]), Path(os.environ[TRITON_ENV])
    files = count_files(inductor) + (count_files(triton) if not _inside(triton, inductor) else 0)
    return CompileCache(str(inductor), str(triton), source, cold=files == 0, files_at_start=files)


def count_files(folder: Path) -> int:
    """Files anywhere under `folder` (0 when it does not exist).

    >>> count_files(Path("/nonexistent-vlmrl-folder"))
    0
    """
    if not folder.is_dir():
        return 0
    return sum(len(files) for _, _, files in os.walk(folder))


def _inside(child: Path, parent: Path) -> bool:
    """
    >>> _inside(Path("/a/b/triton"), Path("/a/b"))
    True
    >>> _inside(Path("/a/triton"), Path("/a/b"))
    False
    """
    return child == parent or parent in child.parents
