"""Provenance: which vlmrl made a file and when, so a record read months later says where it came from.

`provenance()` gives the vlmrl version, the git commit (with a `-dirty` mark) when vlmrl runs from a source
checkout, and start/end timestamps in UTC. env.json, the stage summaries and the evaluation records carry it.

Left out: hashing the installed package files (a wheel's version already names them).
"""

from __future__ import annotations

import functools
import importlib.metadata
import subprocess
from datetime import UTC, datetime
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[3]  # the checkout root when running from src/


@functools.cache
def vlmrl_version() -> str:
    return package_version("vlmrl") or "unknown"  # "unknown": run from a checkout that was never installed


def package_version(dist: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def git_commit(root: Path = SOURCE_ROOT) -> str | None:
    """The commit of the checkout vlmrl runs from (`<sha>-dirty` with local changes), or None when vlmrl is
    installed from a wheel or git is absent."""
    if not (root / ".git").exists() or not (root / "src" / "vlmrl").is_dir():
        return None
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def utc_now() -> str:
    """An ISO 8601 UTC timestamp to the second, e.g. 2026-11-30T18:00:00Z."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def provenance(*, started_at: str | None = None, finished_at: str | None = None) -> dict:
    """{vlmrl_version, git_commit[, started_at, finished_at]}."""
    stamp: dict = {"vlmrl_version": vlmrl_version(), "git_commit": git_commit()}
    if started_at:
        stamp["started_at"] = started_at
    if finished_at:
        stamp["finished_at"] = finished_at
    return stamp
