"""The configured rewards as callables: built-ins by name, the user's own functions from a file or a module.

`load_rewards(config)` turns the `rewards:` list into `Reward`s (name, weight, a guarded TRL-style callable),
refusing with one line a function that cannot be imported, is not callable or has the wrong signature.
`check_rewards` calls every reward once on real held-out items, with the keyword arguments TRL passes, so a
function that raises, returns the wrong length or non-numbers fails before any training or evaluation
rather than mid-run. The guard stays on during training: a reward that fails later is one line too.

A reward's name is its function's `__name__` (TRL names its log columns `rewards/<name>/mean` after it):
`format_reward` and `correctness_reward` for the built-ins. Left out: async reward functions and reward
models (TRL takes both; vlmrl's records assume one plain function per reward).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import numbers
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.config.schema import Config, ConfigError, RewardSpec
from vlmrl.grading import rewards as builtin_rewards
from vlmrl.run.layout import reward_source_file, rewards_fingerprint  # noqa: F401 (rewards_fingerprint: re-exported)

# Names that already are before/after metrics or record fields; a user reward with one would overwrite it.
RESERVED_NAMES = ("accuracy", "mathvista_accuracy", "format_compliance", "total_reward", "exact_match")


class RewardError(ConfigError):
    """A configured reward that cannot be used; the message names the reward and the problem."""


@dataclass(frozen=True)
class Reward:
    name: str  # the function's name: the log column, record key and comparison metric
    weight: float
    fn: Callable[..., list[float | None]]  # guarded: validates the output, errors become RewardError
    label: str  # where it came from, for messages: `name: format` or `function: my.py:f`


def load_rewards(config: Config) -> list[Reward]:
    """Import every configured reward; one clear line (RewardError) for the first that cannot be used."""
    loaded: list[Reward] = []
    for index, spec in enumerate(config.rewards):
        label = f"rewards[{index}] ({'name: ' + spec.name if spec.name else 'function: ' + str(spec.function)})"
        raw = _builtin(spec) if spec.name else _import_function(spec, label)
        _check_signature(raw, label)
        name = _callable_name(raw, spec)
        if name in RESERVED_NAMES or name in {r.name for r in loaded}:
            raise RewardError(f"{label}: the name {name!r} is already taken (by another reward or a metric); "
                              "rename the function.")
        loaded.append(Reward(name, spec.weight, _Guarded(raw, name, label), label))
    return loaded


def reward_kwargs(rows: Sequence[dict]) -> dict[str, list[Any]]:
    """What TRL passes besides prompts/completions: every column, one value per completion.

    >>> reward_kwargs([{"answer": "1", "id": "a"}, {"answer": "2", "id": "b"}])["answer"]
    ['1', '2']
    """
    keys = list(rows[0]) if rows else []
    kwargs: dict[str, list[Any]] = {key: [row.get(key) for row in rows] for key in keys}
    # TRL's hooks: a check or an evaluation has no trainer, so the state is None and logging goes nowhere.
    kwargs.update(trainer_state=None, log_extra=_ignore, log_metric=_ignore)
    return kwargs


def call_rewards(
    loaded: Sequence[Reward], prompts: list, completions: list[str], columns: list[dict]
) -> dict[str, list[float | None]]:
    """Every reward on these completions (one prompt and one columns dict per completion), as TRL calls them."""
    wrapped = [[{"role": "assistant", "content": text}] for text in completions]
    ids = [list(range(len(text.split()))) for text in completions]  # stand-in token ids, one per word
    kwargs = reward_kwargs(columns)
    return {r.name: r.fn(prompts=prompts, completions=wrapped, completion_ids=ids, **kwargs) for r in loaded}


def weighted_total(values: dict[str, float | None], loaded: Sequence[Reward]) -> float:
    """Sum of weight x value over the rewards that scored (None = this reward skips the item, as in TRL).

    >>> weighted_total({"a": 1.0, "b": None}, [Reward("a", 0.5, print, ""), Reward("b", 2.0, print, "")])
    0.5
    """
    return sum(r.weight * values[r.name] for r in loaded if values.get(r.name) is not None)


def check_rewards(loaded: Sequence[Reward], items: Sequence[dict], columns: Sequence[dict], images: Sequence[Any]) -> None:
    """Call every reward once on real held-out items with three fake completions each (a well-formed right
    answer, an empty string, untagged text); raises RewardError on the first failure."""
    prompts, completions, rows = [], [], []
    for item, cols, image in zip(items, columns, images):
        for text in (f"<REASONING>checking</REASONING><SOLUTION>{item['answer']}</SOLUTION>", "", "no tags at all"):
            prompts.append(prompt_messages(item["prompt"], image))
            completions.append(text)
            rows.append(cols)
    if rows:
        call_rewards(loaded, prompts, completions, rows)


def prompt_messages(prompt: str, image: Any) -> list[dict]:
    """The prompt as TRL hands it to reward functions: one user turn, the image block(s) before the text.

    >>> [block["type"] for block in prompt_messages("Q?", ["a", "b"])[0]["content"]]
    ['image', 'image', 'text']
    """
    images = image if isinstance(image, list) else [image]
    blocks = [{"type": "image", "image": one} for one in images]
    return [{"role": "user", "content": [*blocks, {"type": "text", "text": prompt}]}]


class _Guarded:
    """A reward function whose output is checked and whose errors become one line (RewardError)."""

    def __init__(self, fn: Callable[..., Any], name: str, label: str):
        self.fn, self.label = fn, label
        self.__name__ = name  # TRL names the reward's log columns after it

    def __call__(self, prompts=None, completions=None, **kwargs) -> list[float | None]:
        try:
            out = self.fn(prompts=prompts, completions=completions, **kwargs)
        except RewardError:
            raise
        except Exception as exc:  # noqa: BLE001  any failure of the user's code becomes one line
            raise RewardError(f"{self.label}: {self.__name__} raised {_one_line(exc)}") from None
        return _check_output(out, len(completions or []), f"{self.label}: {self.__name__}")


def _check_output(out: Any, expected: int, who: str) -> list[float | None]:
    if not isinstance(out, list | tuple):
        raise RewardError(f"{who} returned {type(out).__name__}, not a list of numbers (one per completion).")
    if len(out) != expected:
        raise RewardError(f"{who} returned {len(out)} values for {expected} completions; return one per completion.")
    bad = [v for v in out if v is not None and not (isinstance(v, numbers.Real) and not isinstance(v, bool))]
    if bad:
        raise RewardError(f"{who} returned {bad[0]!r} ({type(bad[0]).__name__}); each value must be a number or "
                          "None (None = no reward for this completion).")
    return [None if v is None else float(v) for v in out]


def _builtin(spec: RewardSpec) -> Callable[..., Any]:
    # looked up at load time so tests can substitute a built-in
    return getattr(builtin_rewards, f"{spec.name}_reward")


def _import_function(spec: RewardSpec, label: str) -> Callable[..., Any]:
    where, _, attr = str(spec.function).rpartition(":")
    if spec.file is not None:
        path = Path(spec.resolved or spec.file)
        if not _is_file(path):
            raise RewardError(f"{label}: no such file {path} (a reward file is found relative to the config file).")
        module_name = f"vlmrl_user_rewards_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
        try:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001  the user's file: report its error, not ours
            sys.modules.pop(module_name, None)
            raise RewardError(f"{label}: importing {path} failed: {_one_line(exc, path)}") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:  # noqa: BLE001
            raise RewardError(f"{label}: importing module {where!r} failed: {_one_line(exc)}") from None
    if not hasattr(module, attr):
        raise RewardError(f"{label}: {where} has no {attr!r}.")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"{label}: {where}:{attr} is a {type(fn).__name__}, not a function.")
    return fn


def _check_signature(fn: Callable[..., Any], label: str) -> None:
    call = fn if inspect.isroutine(fn) else type(fn).__call__  # a callable object: its __call__
    if inspect.iscoroutinefunction(call):
        raise RewardError(f"{label}: async reward functions are not supported; make it a plain def.")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # a builtin or C callable without a signature: the call check will judge it
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind is p.VAR_KEYWORD for p in params) or "completions" not in names:
        raise RewardError(
            f"{label}: wrong signature {inspect.signature(fn)}; a reward takes TRL's arguments: "
            "`def f(completions, **kwargs)` (kwargs: prompts, completion_ids and every dataset column)."
        )


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
    (their prompts, images and columns, and three fake completions each). Raises RewardError."""
    from vlmrl.common.io import read_jsonl
    from vlmrl.data.items import open_record_images

    loaded = load_rewards(config)
    rows = read_jsonl(run_dir / "data" / "holdout.jsonl")[:items]
    images = [open_record_images(run_dir, row) for row in rows]
    columns = [item_columns(row, image) for row, image in zip(rows, images)]
    check_rewards(loaded, rows, columns, images)
    return loaded


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


