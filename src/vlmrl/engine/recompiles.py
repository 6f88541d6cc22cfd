"""Where dynamo stopped compiling a function: its recompile-limit hits, caught from its log.

A compiled function that meets a new shape or guard at each call (an input that grows by a column a token, say)
is recompiled up to `torch._dynamo.config.recompile_limit` times; past that, dynamo runs it eagerly for the rest of
the process and says so once, as a warning in its log. A rollout that decodes eagerly is several times slower,
and a benchmark that timed it would present that slow path as the engine's. `recompile_limit_hits()` collects
those warnings for the duration of a block; rollouts and compiled evaluation run inside
`reported_recompile_limits`, which says each at WARNING and keeps it on the trainer (`trainer_hits`, which
train/summary.json lists), and the bench records them beside each path's figures.

Public: `LimitHit`, `recompile_limit_hits` (a context manager yielding the list it fills),
`reported_recompile_limits`, `trainer_hits`.
Limits: it reads dynamo's own warning (logger `torch._dynamo.convert_frame`), so it sees nothing where a
`TORCH_LOGS` setting silences dynamo's warnings.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)
DYNAMO_LOGGER = "torch._dynamo.convert_frame"
_HIT = re.compile(r"hit config\.(\w+) \((\d+)\)\s*\n\s*function: (.*)\n\s*last reason: (.*)")


@dataclass(frozen=True)
class LimitHit:
    """One function dynamo gave up recompiling: the limit it hit, the function, and the last guard that failed."""

    limit: str
    function: str
    reason: str

    def line(self) -> str:
        return (f"dynamo hit its {self.limit} compiling {self.function} and runs it eagerly from now on "
                f"(last recompile: {self.reason})")


class _Catcher(logging.Handler):
    def __init__(self, hits: list[LimitHit]):
        super().__init__(logging.WARNING)
        self.hits = hits

    def emit(self, record: logging.LogRecord) -> None:
        match = _HIT.search(record.getMessage())
        if match:
            self.hits.append(LimitHit(match[1], match[3].strip(), match[4].strip()))


@contextlib.contextmanager
def recompile_limit_hits() -> Iterator[list[LimitHit]]:
    """Inside the block, every recompile limit dynamo hits is appended to the yielded list.

    >>> with recompile_limit_hits() as hits:
    ...     logging.getLogger(DYNAMO_LOGGER).warning(
    ...         "torch._dynamo hit config.%s (%s)\\n   function: %s\\n   last reason: %s\\nTo log all ...",
    ...         "recompile_limit", 8, "'f' (a.py:1)", "0/7: tensor 'x' size mismatch at index 1")
    >>> hits[0].function, hits[0].limit
    ("'f' (a.py:1)", 'recompile_limit')
    """
    hits: list[LimitHit] = []
    handler = _Catcher(hits)
    logger = logging.getLogger(DYNAMO_LOGGER)
    logger.addHandler(handler)
    try:
        yield hits
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def reported_recompile_limits(trainer: Any = None) -> Iterator[None]:
    """Inside the block (a rollout, a compiled evaluation), each function dynamo stops compiling is said once at
    WARNING, and kept in `trainer.vlmrl_recompile_limit_hits` when a trainer is given: from then on that part of
    generation runs eagerly."""
    with recompile_limit_hits() as hits:
        try:
            yield
        finally:
            for hit in hits:
                log.warning("%s; generation runs that part eagerly for the rest of this run, several times slower "
                            "(TORCH_LOGS=recompiles lists each recompile and why)", hit.line())
            if hits and trainer is not None:
                trainer.vlmrl_recompile_limit_hits = [*getattr(trainer, "vlmrl_recompile_limit_hits", []), *hits]


def trainer_hits(trainer: Any) -> list[dict]:
    """The limit hits `reported_recompile_limits` kept on `trainer` over its rollouts, as plain dicts (none: [])."""
    return [asdict(hit) for hit in getattr(trainer, "vlmrl_recompile_limit_hits", [])]
