"""The configured rewards as callables: built-ins by name, the user's own functions from a file or a module.

`load_rewards(config)` turns the `rewards:` list into `Reward`s (name, weight, a guarded TRL-style callable),
refusing with one line a function that cannot be imported, is not callable or has a signature TRL could not
call (every argument comes by keyword, so `**kwargs` is needed; `completion_ids`-only and async functions are
fine). A reward file is imported once per process and version of the file, within the entry's `timeout_s`
(`reward_call.bounded_import`): a hang, any exception or `os._exit()` at import is one line too. A reward's
`columns` hands it dataset columns under its own argument names (`solution: answer` for
`trl.rewards.accuracy_reward`). `check_rewards` calls every reward once on real held-out items, with the
keyword arguments TRL passes (`trainer_state` a state at step 0), so a function that raises, returns the
wrong length or non-numbers fails before any training or evaluation rather than mid-run; a reward that gives
a correct, well-formed completion no more than an empty one is one warning naming the contract it seems to
expect, once per run, and none for a reward whose scores only follow the completions' length. The guard
stays on during training: a reward that fails later is one line too.

A reward's name is its function's `__name__` (TRL names its log columns `rewards/<name>/mean` after it):
`format_reward` and `correctness_reward` for the built-ins. Left out: reward models (TRL takes them; vlmrl's
records assume one function per reward).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import itertools
import logging
import math
import sys
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.config.schema import Config, RewardSpec
from vlmrl.config.sections import TRL_REWARD_ARGUMENTS
from vlmrl.contract import CONTRACTS, render_answer
from vlmrl.grading import rewards as builtin_rewards
from vlmrl.grading.reward_call import RewardError, bounded_import, call_reward
from vlmrl.run.layout import reward_source_file, rewards_fingerprint  # noqa: F401 (rewards_fingerprint: re-exported)

# Names that already are before/after metrics or record fields; a user reward with one would overwrite it.
RESERVED_NAMES = ("accuracy", "mathvista_accuracy", "format_compliance", "total_reward", "exact_match")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reward:
    name: str  # the function's name: the log column, record key and comparison metric
    weight: float
    fn: Callable[..., list[float | None]]  # guarded: validates the output, errors become RewardError
    label: str  # where it came from, for messages: `name: format` or `function: my.py:f`
    needs: tuple[str, ...] = ()  # keyword arguments it requires (after its `columns` renaming)


def load_rewards(config: Config) -> list[Reward]:
    """Import every configured reward; one clear line (RewardError) for the first that cannot be used."""
    loaded: list[Reward] = []
    for index, spec in enumerate(config.rewards):
        label = f"rewards[{index}] ({'name: ' + spec.name if spec.name else 'function: ' + str(spec.function)})"
        raw = _builtin(spec, config.contract) if spec.name else _import_function(spec, label)
        needs = _check_signature(raw, label)
        name = _callable_name(raw, spec)
        if name in RESERVED_NAMES or name in {r.name for r in loaded}:
            raise RewardError(f"{label}: the name {name!r} is already taken (by another reward or a metric); "
                              "rename the function.")
        if spec.columns or _is_async(raw):
            raw = _Adapted(raw, spec.columns, name, label)
        needs = tuple(spec.columns.get(arg, arg) for arg in needs)  # what the columns must provide
        # a user function gets its time limit; a built-in bounds its own work (linear in the text, each expression
        # comparison in a killable worker), so a large batch of hard expressions cannot trip a limit meant for hangs
        timeout_s = spec.timeout_s if spec.function else None
        loaded.append(Reward(name, spec.weight, _Guarded(raw, name, label, timeout_s), label, needs))
    return loaded


def reward_kwargs(rows: Sequence[dict]) -> dict[str, list[Any]]:
    """What TRL passes besides prompts/completions: every column, one value per completion.

    >>> reward_kwargs([{"answer": "1", "id": "a"}, {"answer": "2", "id": "b"}])["answer"]
    ['1', '2']
    """
    keys = list(rows[0]) if rows else []
    kwargs: dict[str, list[Any]] = {key: [row.get(key) for row in rows] for key in keys}
    # TRL's hooks: a check or an evaluation has no trainer: a fresh state (step 0), logging goes nowhere.
    kwargs.update(trainer_state=_step_zero_state(), log_extra=_ignore, log_metric=_ignore)
    return kwargs


def _step_zero_state() -> Any:
    from transformers import TrainerState

    return TrainerState()


def call_rewards(
    loaded: Sequence[Reward], prompts: list, completions: list[str], columns: list[dict]
) -> dict[str, list[float | None]]:
    """Every reward on these completions (one prompt and one columns dict per completion), as TRL calls them."""
    wrapped = [[{"role": "assistant", "content": text}] for text in completions]
    ids = [list(range(len(text.split()))) for text in completions]  # stand-in token ids, one per word
    kwargs = reward_kwargs(columns)
    return {r.name: r.fn(prompts=prompts, completions=wrapped, completion_ids=ids, **kwargs) for r in loaded}


def weighted_total(values: dict[str, float | None], loaded: Sequence[Reward]) -> float:
    """Sum of weight x value over the rewards that scored (None = this reward skips the item, as in TRL);
    RewardError when it is not a finite number (a check after summing; each value is within +-MAX_REWARD).

    >>> weighted_total({"a": 1.0, "b": None}, [Reward("a", 0.5, print, ""), Reward("b", 2.0, print, "")])
    0.5
    """
    scored = [r for r in loaded if values.get(r.name) is not None]
    total = sum(r.weight * values[r.name] for r in scored)
    if not math.isfinite(total):
        terms = " + ".join(f"{r.weight:g} x {values[r.name]:g} ({r.name})" for r in scored)
        raise RewardError(f"the weighted total of the rewards, {terms}, is {total:g}, not a finite number; lower "
                          "the weights.")
    return total


PROBES = ("well_formed", "empty", "untagged", "other_contract")  # the check's fake completions, per item


def check_rewards(loaded: Sequence[Reward], items: Sequence[dict], columns: Sequence[dict], images: Sequence[Any],
                  *, contract: str = "seed", run: str | None = None) -> dict[str, dict[str, float | None]]:
    """Call every reward once on real held-out items with four fake completions each (`PROBES`: a correct,
    well-formed answer under `contract`, an empty string, untagged text, and the same answer well-formed
    under the other contract); raises RewardError on the first failure. Returns each reward's mean per probe
    (None where it scored nothing) and warns, one line each, about a reward that gives the well-formed answer
    no more than the empty completion, unless its scores only follow the completions' length (a length reward
    does so by design); given `run` (its folder), a warning is said once per run in this process (the baseline,
    training and the final evaluation each check)."""
    if not items:
        return {}
    _check_arguments(loaded, columns[0])
    other = next(c for c in CONTRACTS if c != contract)
    prompts, completions, rows = [], [], []
    for item, cols, image in zip(items, columns, images):
        texts = (render_answer("checking", str(item["answer"]), contract), "", "no tags at all",
                 render_answer("checking", str(item["answer"]), other))
        for text in texts:
            prompts.append(prompt_messages(item["prompt"], image))
            completions.append(text)
            rows.append(cols)
    values = call_rewards(loaded, prompts, completions, rows)
    means = {name: {probe: _mean(scores[k::len(PROBES)]) for k, probe in enumerate(PROBES)}
             for name, scores in values.items()}
    lengths = {probe: sum(map(len, completions[k::len(PROBES)])) for k, probe in enumerate(PROBES)}
    for reward in loaded:
        warning = _unrewarded(reward, means[reward.name], contract, other)
        if warning and not _by_length(means[reward.name], lengths) and (run, warning) not in _WARNED:
            log.warning(warning)
            if run is not None:
                _WARNED.add((run, warning))
    return means


_WARNED: set[tuple[str, str]] = set()  # (run folder, warning) already said by this process


def _by_length(means: dict[str, float | None], lengths: dict[str, int]) -> bool:
    """Whether a reward's probe scores only follow the probes' lengths, shorter scoring higher and not all equal:
    a length reward, for which a well-formed answer scoring below an empty one is the design.

    >>> _by_length({"a": 1.0, "b": 0.5, "c": 0.0}, {"a": 0, "b": 14, "c": 40})
    True
    >>> _by_length({"a": 0.0, "b": 0.0, "c": 0.0}, {"a": 0, "b": 14, "c": 40})  # flat: it reads nothing
    False
    """
    if any(value is None for value in means.values()):
        return False
    ordered = [means[probe] for probe in sorted(means, key=lengths.__getitem__)]
    return ordered[0] > ordered[-1] and all(a >= b for a, b in itertools.pairwise(ordered))


def _check_arguments(loaded: Sequence[Reward], columns: dict) -> None:
    """A reward requiring an argument that neither TRL nor any column provides: one line, with the fix."""
    available = set(TRL_REWARD_ARGUMENTS) | set(columns)
    for reward in loaded:
        missing = [arg for arg in reward.needs if arg not in available]
        if missing:
            raise RewardError(
                f"{reward.label}: {reward.name} takes {', '.join(map(repr, missing))}, which is no column of the "
                f"data (columns: {', '.join(sorted(columns))}); give it one under that name with this reward's "
                f"`columns`, e.g. columns: {{{missing[0]}: answer}}.")


def check_data_columns(config: Config, loaded: Sequence[Reward]) -> None:
    """`vlmrl config validate`'s form of the check `check_rewards` makes on prepared items: every argument a
    reward requires is one TRL passes or a column the data will give (`vlmrl.data.table.expected_columns`;
    skipped where that cannot be told before preparing). Raises RewardError."""
    from vlmrl.data.table import expected_columns

    names = expected_columns(config.data)
    if names is not None:
        _check_arguments(loaded, dict.fromkeys(names))


def _unrewarded(reward: Reward, means: dict[str, float | None], contract: str, other: str) -> str | None:
    """The warning for a reward that scores a correct, well-formed completion no higher than an empty one."""
    well, empty, elsewhere = means["well_formed"], means["empty"], means["other_contract"]
    if well is None or empty is None or well > empty:
        return None
    expects = (f"it seems to expect `contract: {other}`" if elsewhere is not None and elsewhere > empty
               else "it seems to expect neither contract's form (or another column: see its `columns`)")
    return (f"{reward.label}: {reward.name} gives a correct, well-formed `{contract}` completion {well:.2f}, "
            f"no more than an empty one ({empty:.2f}); {expects}.")


def _mean(values: Sequence[float | None]) -> float | None:
    scored = [v for v in values if v is not None]
    return sum(scored) / len(scored) if scored else None


def prompt_messages(prompt: str, image: Any) -> list[dict]:
    """The prompt as TRL hands it to reward functions: one user turn, the image block(s) before the text.

    >>> [block["type"] for block in prompt_messages("Q?", ["a", "b"])[0]["content"]]
    ['image', 'image', 'text']
    """
    images = image if isinstance(image, list) else [image]
    blocks = [{"type": "image", "image": one} for one in images]
    return [{"role": "user", "content": [*blocks, {"type": "text", "text": prompt}]}]


class _Guarded:
    """A reward function called on its own copies, within its time limit, its values checked, every failure one
    line (RewardError): `vlmrl.grading.reward_call`."""

    def __init__(self, fn: Callable[..., Any], name: str, label: str, timeout_s: float | None):
        self.fn, self.label, self.timeout_s = fn, label, timeout_s
        self.__name__ = name  # TRL names the reward's log columns after it

    def __call__(self, prompts=None, completions=None, **kwargs) -> list[float | None]:
        return call_reward(self.fn, f"{self.label}: {self.__name__}", timeout_s=self.timeout_s, prompts=prompts,
                           completions=list(completions or []), kwargs=kwargs)


def _builtin(spec: RewardSpec, contract: str) -> Callable[..., Any]:
    # looked up at load time so tests can substitute a built-in
    fn = getattr(builtin_rewards, f"{spec.name}_reward")
    return fn if contract == "seed" else builtin_rewards.builtin_reward(str(spec.name), contract)


def _import_function(spec: RewardSpec, label: str) -> Callable[..., Any]:
    where, _, attr = str(spec.function).rpartition(":")
    if spec.file is not None:
        path = Path(spec.resolved or spec.file)
        if not _is_file(path):
            raise RewardError(f"{label}: no such file {path} (a reward file is found relative to the config file).")
        module = _file_module(path, attr, label, spec.timeout_s)
    else:
        if spec.resolved and spec.resolved not in sys.path:  # the package beside the config file
            sys.path.append(spec.resolved)
        module = _named_module(where, label, spec.timeout_s)
    if not hasattr(module, attr):
        raise RewardError(f"{label}: {where} has no {attr!r}.")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"{label}: {where}:{attr} is a {type(fn).__name__}, not a function.")
    return fn


# A reward file's module (or why it cannot be imported) per (path, sha256 of its bytes): a process imports each
# version of a file once, however many stages load the rewards; a changed file is imported again.
_IMPORTED: dict[tuple[str, str], Any] = {}


def _file_module(path: Path, attr: str, label: str, timeout_s: float | None) -> Any:
    key = (str(path.resolve()), hashlib.sha256(path.read_bytes()).hexdigest())
    if key not in _IMPORTED:
        _IMPORTED[key] = _import_file(path, attr, label, timeout_s)
    if isinstance(_IMPORTED[key], RewardError):
        raise _IMPORTED[key]
    return _IMPORTED[key]


def _import_file(path: Path, attr: str, label: str, timeout_s: float | None) -> Any:
    """The module of `path`, or the RewardError that says why not (kept: the same file fails the same way)."""
    module_name = f"vlmrl_user_rewards_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"

    def load() -> Any:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module

    try:
        module, exc = bounded_import(load, f"{label}: importing {path}", timeout_s)
    except RewardError as late:
        sys.modules.pop(module_name, None)
        return late
    if exc is not None:  # the user's file (sys.exit(), GeneratorExit too): its error, not ours
        sys.modules.pop(module_name, None)
        if isinstance(exc, ImportError) and (dotted := _package_module(path)):
            return RewardError(
                f"{label}: {path} belongs to the package {dotted.split('.')[0]!r} and imports from it; name it "
                f"as a module instead: `function: {dotted}:{attr}` (its package beside the config file or on "
                "PYTHONPATH).")
        return RewardError(f"{label}: importing {path} failed: {_one_line(exc, path)}")
    return module


def _named_module(where: str, label: str, timeout_s: float | None) -> Any:
    if isinstance(_IMPORTED.get(("module", where)), RewardError):  # it timed out: its import lock is still held
        raise _IMPORTED[("module", where)]
    try:
        module, exc = bounded_import(lambda: importlib.import_module(where), f"{label}: importing module {where!r}",
                                     timeout_s)
    except RewardError as late:
        _IMPORTED[("module", where)] = late
        raise
    if exc is not None:  # sys.exit() at import too
        raise RewardError(f"{label}: importing module {where!r} failed: {_one_line(exc)}")
    return module


def _check_signature(fn: Callable[..., Any], label: str) -> tuple[str, ...]:
    """Refuse what TRL could not call (it passes every argument by keyword, more than any one reward takes);
    returns the keyword arguments `fn` requires. `(completions, **kwargs)`, `(completion_ids, **kwargs)`,
    `(prompts, completions, solution, **kwargs)` and their async forms are all fine."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ()  # a builtin or C callable without a signature: the call check will judge it
    positional = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if not any(p.kind is p.VAR_KEYWORD for p in params) or positional:
        raise RewardError(
            f"{label}: wrong signature {inspect.signature(fn)}; TRL calls a reward with keyword arguments only "
            "(prompts, completions, completion_ids, every dataset column and its hooks), so it must take "
            "**kwargs and no positional-only argument: `def f(completions, **kwargs)`."
        )
    return tuple(p.name for p in params
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty)


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn if inspect.isroutine(fn) else type(fn).__call__)


class _Adapted:
    """A reward as TRL would call it, plus what vlmrl's synchronous calls need: the reward's `columns`
    given under its own argument names, and an async function's result awaited (a class: TRL pickles it)."""

    def __init__(self, fn: Callable[..., Any], columns: dict[str, str], name: str, label: str):
        self.fn, self.columns, self.label, self.__name__ = fn, dict(columns), label, name

    def __call__(self, **kwargs: Any) -> Any:
        for argument, column in self.columns.items():
            if column not in kwargs:
                given = sorted(k for k in kwargs if k not in TRL_REWARD_ARGUMENTS)
                raise RewardError(f"{self.label}: columns: {{{argument}: {column}}} names no column of the data "
                                  f"(columns: {', '.join(given)}).")
            kwargs[argument] = kwargs[column]
        out = self.fn(**kwargs)
        return _awaited(out) if inspect.isawaitable(out) else out


def _awaited(coroutine: Any) -> Any:
    """Run an async reward's coroutine to its result, in a thread of its own when a loop already runs here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _package_module(path: Path) -> str | None:
    """`pkg.sub.mod` for a file inside a package (folders holding `__init__.py`), else None."""
    parts, folder = [path.stem], path.resolve().parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts) if len(parts) > 1 else None


def _callable_name(fn: Callable[..., Any], spec: RewardSpec) -> str:
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():  # a lambda or a callable object
        name = str(spec.function).rpartition(":")[2]
    return name


def _one_line(exc: BaseException, path: Path | None = None) -> str:
    """`Type: message`, plus the line of the user's file where it happened when known."""
    text = f"{type(exc).__name__}: {(str(exc) or '').splitlines()[0] if str(exc) else ''}".rstrip(": ")
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"{text} (line {exc.lineno})"
    mine = [f for f in frames if path is None or Path(f.filename) == path]
    return f"{text} (line {mine[-1].lineno})" if mine and path is not None else text


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the file system, say
        return False


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def check_run_rewards(config: Config, run_dir: Path, *, items: int = 4) -> list[Reward]:
    """Load the configured rewards and call each once on the first `items` held-out items of `run_dir`
    (their prompts, images and columns, and the fake completions of `check_rewards`). Raises RewardError."""
    return reward_check(config, run_dir, items=items)[0]


def reward_check(config: Config, run_dir: Path, *, items: int = 4) -> tuple[list[Reward], dict]:
    """`check_run_rewards`, and what the check measured: each reward's mean per fake completion (`PROBES`)."""
    from vlmrl.common.io import read_jsonl
    from vlmrl.data.items import open_record_images

    loaded = load_rewards(config)
    rows = read_jsonl(run_dir / "data" / "holdout.jsonl")[:items]
    images = [open_record_images(run_dir, row) for row in rows]
    columns = [item_columns(row, image) for row, image in zip(rows, images)]
    return loaded, check_rewards(loaded, rows, columns, images, contract=config.contract, run=str(run_dir.resolve()))


def item_columns(row: dict, image: Any = None) -> dict[str, Any]:
    """The reward kwargs of one held-out/train record: `Item.columns()`, plus the image as TRL's dataset
    column hands it over (`image`: a PIL image; `images`: a list of them, for a several-image item)."""
    from vlmrl.data.items import Item

    try:
        columns = Item.from_json(row).columns()
    except (ValueError, TypeError):  # a partial record (hand-made in a test): its fields as they are
        columns = {k: v for k, v in row.items()
                   if k not in ("image", "images", "image_sha256", "image_sha256s", "prompt", "metadata")}
    if image is not None:
        columns["images" if isinstance(image, list) else "image"] = image
    return columns


