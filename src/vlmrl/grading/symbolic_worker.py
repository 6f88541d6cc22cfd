"""The math-verify process behind ``vlmrl.grading.symbolic``: one JSON request per line in, one JSON answer per line out.

Started by ``vlmrl.grading.symbolic`` as ``python -P <this file> <budget seconds>``; it imports nothing from vlmrl, so it
starts the same however the parent found the package. A request ``{"gold": str, "pred": str}`` is answered
``{"equal": bool}``, plus ``"error"`` when the comparison could not finish (then ``equal`` is false). The first
line it writes is ``{"ready": true}``, or ``{"error": ...}`` when math-verify cannot be imported.

Each request gets ``budget`` seconds from an interval timer: signals work here because this is the main
thread of its own process, and a sub-second budget is possible (math-verify's own timeout is ``signal.alarm``,
whole seconds). Work stuck inside one C call (sympy computing ``2^{10^{10}}``) ignores signals; the parent
ends that by killing this process. The address space is capped so such work fails fast with MemoryError
instead of swapping the machine.

Left out: math-verify's free-text number extraction (``ExprExtractionConfig`` reads ``5 and 6`` as ``6``);
answers are read as LaTeX only, after a few plain-text spellings are mapped to LaTeX (``pi``, ``**``, ``√``).
"""

from __future__ import annotations

import json
import logging
import re
import resource
import signal
import sys

MEMORY_BYTES = 2 << 30  # sympy + math-verify use ~70 MB of address space; 2 GiB leaves room, not a swap storm

# Plain-text spellings a policy writes that LaTeX reads otherwise (``pi`` would be p*i).
_PLAIN_TO_LATEX = (
    (re.compile(r"(?<![\\A-Za-z])pi(?![A-Za-z])"), r"\\pi "),
    (re.compile(r"\*\*"), "^"),
    (re.compile("\u221a"), r"\\sqrt "),  # √
    (re.compile("\u03c0"), r"\\pi "),  # π
    (re.compile(r"(?<![\\A-Za-z])(?:infinity|inf)(?![A-Za-z])"), r"\\infty "),
)


class _OutOfTime(BaseException):
    """Raised by the interval timer; a BaseException so math-verify's ``except Exception`` cannot swallow it."""


def _on_alarm(signum: int, frame: object) -> None:
    raise _OutOfTime


def _as_latex(text: str) -> str:
    for pattern, replacement in _PLAIN_TO_LATEX:
        text = pattern.sub(replacement, text)
    return text


def _parse(text: str) -> list:
    """What math-verify reads in ``text``: as written (``$..$``, ``\\boxed{..}``), else as inline math."""
    from math_verify import LatexExtractionConfig, parse

    config = [LatexExtractionConfig()]
    found = parse(text, extraction_config=config, parsing_timeout=None)
    if not found:
        found = parse(f"${_as_latex(text)}$", extraction_config=config, parsing_timeout=None)
    return found


def _equal(gold: str, pred: str) -> bool:
    from math_verify import verify

    gold_parsed = _parse(gold)
    if not gold_parsed:
        return False
    pred_parsed = _parse(pred)
    return bool(pred_parsed) and bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def answer(request: object, budget: float) -> dict:
    """The reply to one request, within ``budget`` seconds of Python work."""
    gold, pred = (request.get("gold"), request.get("pred")) if isinstance(request, dict) else (None, None)
    if not isinstance(gold, str) or not isinstance(pred, str):
        return {"equal": False, "error": "request needs string gold and pred"}
    signal.setitimer(signal.ITIMER_REAL, budget)
    try:
        try:
            return {"equal": _equal(gold, pred)}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _OutOfTime:
        return {"equal": False, "error": "timeout"}
    except (Exception, MemoryError, RecursionError) as exc:  # noqa: BLE001 - any failure is "not shown equal"
        return {"equal": False, "error": f"{type(exc).__name__}: {exc}"[:200]}


def main(argv: list[str]) -> int:
    budget = float(argv[1]) if len(argv) > 1 else 1.0
    replies = sys.stdout
    sys.stdout = sys.stderr  # nothing a library prints may corrupt the protocol
    try:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    except (ValueError, OSError):  # a lower hard limit is already in place: keep it
        pass
    try:
        import math_verify  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        reason = f"math-verify cannot be imported ({type(exc).__name__}: {exc})"
        replies.write(json.dumps({"error": reason}) + "\n")
        replies.flush()
        return 1
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # "timeout disabled" warnings: ours is on
    signal.signal(signal.SIGALRM, _on_alarm)
    replies.write('{"ready": true}\n')
    replies.flush()
    for line in sys.stdin:
        try:
            reply = answer(json.loads(line), budget)
        except _OutOfTime:  # the timer fired just as it was being cancelled
            reply = {"equal": False, "error": "timeout"}
        except ValueError as exc:
            reply = {"equal": False, "error": f"bad request: {exc}"[:200]}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
