"""Where vlmrl keeps what it builds once per machine (the demo policies, torch.compile's caches):
`~/.cache/vlmrl`, or `$VLMRL_CACHE`. Public: `cache_root`."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("VLMRL_CACHE", Path.home() / ".cache" / "vlmrl"))
