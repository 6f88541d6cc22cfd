"""The two GRPO rewards: did the policy follow the output structure, and is its answer right.

Both are plain TRL reward functions, ``(completions, **kwargs) -> list[float]``, passed to ``GRPOTrainer`` as
``reward_funcs`` with ``DEFAULT_REWARD_WEIGHTS`` going to ``GRPOConfig.reward_weights`` (TRL 1.x takes the
weights only there). They score the ``seed`` contract unless called with ``contract="think"``
(``builtin_reward`` binds the config's contract; the rules are in ``vlmrl.contract``). They score whatever a policy emits, so they never raise on text and stay linear in its
length: tags are counted with ``str.count``/``str.find``, never with backtracking regexes, and the numeric
comparison only looks at short solutions (see ``grading.MAX_NUMBER_CHARS``).

Left out on purpose: partial credit for near-misses and length penalties; the seed recipe has neither.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from vlmrl.contract import DEGENERATE_TOKEN, completion_text, extract_answer, format_checks
from vlmrl.grading.grader import grade, numeric_equal

__all__ = [
    "DEFAULT_REWARD_WEIGHTS",
    "REWARD_FUNCS",
    "builtin_reward",
    "correctness_reward",
    "extract_solution",
    "format_reward",
    "is_degenerate",
    "numeric_equal",
    "reward_functions",
    "score_completion",
]

logger = logging.getLogger(__name__)

# (format, correctness): the seed recipe's weights; correctness dominates, format only shapes early training.
DEFAULT_REWARD_WEIGHTS: tuple[float, float] = (0.3, 1.0)

EXACT_MATCH_REWARD = 2.0
NUMERIC_MATCH_REWARD = 1.5
DEGENERATE_PENALTY = -2.0


def extract_solution(text: str) -> str | None:
    """The stripped text between the one ``<SOLUTION>`` and the one ``</SOLUTION>``, else None.

    >>> extract_solution("<REASONING>2+2</REASONING><SOLUTION> 4 </SOLUTION>")
    '4'
    >>> extract_solution("<SOLUTION>4</SOLUTION><SOLUTION>5</SOLUTION>") is None  # two answers: neither counts
    True
    """
    return extract_answer(text, "seed")


def is_degenerate(text: str) -> bool:
    """Whether ``text`` shows the collapse seen in Qwen-VL RL runs: ``addCriterion`` spam or mostly newlines.

    >>> is_degenerate("addCriterion"), is_degenerate("\\n\\n\\nok"), is_degenerate("fine\\n"), is_degenerate("")
    (True, True, False, False)
    """
    if DEGENERATE_TOKEN in text:
        return True
    junk = text.count("\n") + len(DEGENERATE_TOKEN) * text.count(DEGENERATE_TOKEN)
    return bool(text) and 2 * junk >= len(text)


def format_reward(completions: Sequence[object], *, contract: str = "seed", **kwargs: object) -> list[float]:
    """+1 for one well-ordered ``<REASONING>`` pair, +1 for one ``<SOLUTION>`` pair, -2 if degenerate.

    Under ``contract="think"``: +1 for the text opening with its one ``<think>...</think>``, +1 for one
    ``\\boxed{}`` after it, -2 if degenerate (``vlmrl.contract.format_checks``).

    >>> format_reward(["<REASONING>r</REASONING><SOLUTION>1</SOLUTION>", "<SOLUTION>1</SOLUTION>", "hi"])
    [2.0, 1.0, 0.0]
    >>> format_reward([[{"role": "assistant", "content": "<SOLUTION>1</SOLUTION>addCriterion"}], None])
    [-1.0, 0.0]
    >>> format_reward(["<think>r</think>\\n\\\\boxed{1}", "<SOLUTION>1</SOLUTION>"], contract="think")
    [2.0, 0.0]
    """
    texts = _texts(completions)
    return [0.0 if text is None else _format_score(text, contract) for text in texts]


def correctness_reward(
    completions: Sequence[object], answer: Sequence[object], *, contract: str = "seed", **kwargs: object
) -> list[float]:
    """2.0 when the solution equals the gold answer exactly, 1.5 when ``grade`` says it is right, else 0.

    TRL passes every dataset column as a list aligned with ``completions``: ``answer_type``, ``choices`` and
    ``precision`` (each optional) pick the grading rule per item (``vlmrl.grading.grader.grade``); without
    ``answer_type`` an item is graded as a number, as the seed recipe's are. The answer is read under
    ``contract`` (``<SOLUTION>`` for seed, ``\\boxed{}`` after ``</think>`` for think).

    >>> correctness_reward(["<SOLUTION>42</SOLUTION>", "<SOLUTION>42.0</SOLUTION>", "42"], ["42", "42", "42"])
    [2.0, 1.5, 0.0]
    >>> correctness_reward(["<SOLUTION>(B)</SOLUTION>"], ["7"], answer_type=["choice"], choices=[["6", "7"]])
    [1.5]
    """
    if len(answer) != len(completions):
        raise ValueError(
            f"correctness_reward got {len(completions)} completions but {len(answer)} answers; the dataset's "
            "`answer` column must hold one gold answer per prompt (TRL repeats it per generation)"
        )
    columns = {}
    for name in ("answer_type", "choices", "precision"):
        column = kwargs.get(name)
        columns[name] = [None] * len(completions) if column is None else column
        if len(columns[name]) != len(completions):
            raise ValueError(
                f"correctness_reward got {len(completions)} completions but {len(columns[name])} values of "
                f"`{name}`; that dataset column must hold one value per prompt, as `answer` does"
            )
    texts = _texts(completions)
    return [
        0.0
        if text is None
        else _correctness_score(text, _gold_text(gold), answer_type=kind, choices=options, precision=digits,
                                contract=contract)
        for text, gold, kind, options, digits in zip(
            texts, answer, columns["answer_type"], columns["choices"], columns["precision"]
        )
    ]


REWARD_FUNCS: list[Callable[..., list[float]]] = [format_reward, correctness_reward]


def reward_functions() -> list[Callable[..., list[float]]]:
    """A fresh ``[format_reward, correctness_reward]``, in the order ``DEFAULT_REWARD_WEIGHTS`` assumes."""
    return list(REWARD_FUNCS)


def builtin_reward(name: str, contract: str = "seed") -> Callable[..., list[float]]:
    """The built-in ``<name>_reward`` scoring ``contract``: the plain function for seed, else a picklable
    callable under the same ``__name__`` (TRL's log column and the records' key stay ``format_reward``...).

    >>> builtin_reward("format", "think")(["<think>r</think>\\\\boxed{1}"])
    [2.0]
    """
    fn = {"format": format_reward, "correctness": correctness_reward}[name]
    return fn if contract == "seed" else _UnderContract(fn, contract)


class _UnderContract:
    """A built-in reward with its contract bound (a class, not a closure, so TRL can pickle it)."""

    def __init__(self, fn: Callable[..., list[float]], contract: str):
        self.fn, self.contract, self.__name__ = fn, contract, fn.__name__

    def __call__(self, completions: Sequence[object], **kwargs: object) -> list[float]:
        return self.fn(completions, **{**kwargs, "contract": self.contract})  # a `contract` column never wins


def score_completion(
    text: str,
    gold: str,
    weights: tuple[float, float] = DEFAULT_REWARD_WEIGHTS,
    *,
    answer_type: str | None = None,
    choices: Sequence[str] | None = None,
    precision: int | None = None,
    contract: str = "seed",
) -> dict[str, object]:
    """Every reward-side fact about one completion, for evaluation records (one JSONL line per sample).

    ``answer_type``, ``choices`` and ``precision`` are the item's, graded as ``correctness_reward`` does;
    the answer is read and the format checked under ``contract``.

    >>> record = score_completion("<REASONING>r</REASONING><SOLUTION>7</SOLUTION>", "7")
    >>> record["total"], record["format_ok"], record["exact_match"], record["pred"]
    (2.6, True, True, '7')
    """
    format_score = _format_score(text, contract)
    correctness = _correctness_score(text, gold, answer_type=answer_type, choices=choices, precision=precision,
                                     contract=contract)
    return {
        "format": format_score,
        "correctness": correctness,
        "total": weights[0] * format_score + weights[1] * correctness,
        "pred": extract_answer(text, contract),
        "format_ok": format_score == 2.0,
        "correct": correctness > 0,
        "exact_match": correctness == EXACT_MATCH_REWARD,
        "degenerate": is_degenerate(text),
    }


def _format_score(text: str, contract: str = "seed") -> float:
    score = float(sum(format_checks(text, contract)))
    if is_degenerate(text):
        score += DEGENERATE_PENALTY
    return score


def _correctness_score(
    text: str,
    gold: str,
    *,
    answer_type: str | None = None,
    choices: Sequence[str] | None = None,
    precision: int | None = None,
    contract: str = "seed",
) -> float:
    pred = extract_answer(text, contract)
    if pred is None:
        return 0.0
    if pred == gold.strip():
        return EXACT_MATCH_REWARD
    if answer_type is None:  # an item without a type: the seed recipe's numeric rule
        return NUMERIC_MATCH_REWARD if numeric_equal(pred, gold) else 0.0
    if grade(pred, gold, answer_type, choices=choices, precision=precision):
        return NUMERIC_MATCH_REWARD
    return 0.0


def _texts(completions: Sequence[object]) -> list[str | None]:
    """Completion texts; items that are not text become None and are reported once per batch."""
    texts = [completion_text(completion) for completion in completions]
    bad = [index for index, text in enumerate(texts) if text is None]
    if bad:
        logger.warning(
            "%d of %d completions are not text (indices %s); they score 0.0", len(bad), len(texts), bad[:10]
        )
    return texts


def _gold_text(gold: object) -> str:
    # Datasets sometimes store numeric answers as numbers; compare their written form.
    return gold if isinstance(gold, str) else str(gold)
