"""The task contracts: the output structure every stage agrees on (`contract:` in the config).

`seed` (the write-up's, and the default) asks for

    <REASONING>
    ...free-form working...
    </REASONING>
    <SOLUTION>
    42.5
    </SOLUTION>

`think` asks for the form of R1-style and Qwen3 "thinking" models, EasyR1's default, and what TRL's built-in
rewards (`trl.rewards.think_format_reward`, `accuracy_reward`) score:

    <think>
    ...free-form working...
    </think>
    \\boxed{42.5}

The prompt's instruction, answer extraction and the two format checks the format reward adds up live here
and nowhere else; rewards, grading, records and the report ask this module. Left out: several answers per
completion (two `<SOLUTION>` pairs, or two `\\boxed{}` after `</think>`, count as none).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

CONTRACTS: tuple[str, ...] = ("seed", "think")  # `contract:` in the config (vlmrl.config.schema.Config)

REASONING_START = "<REASONING>"
REASONING_END = "</REASONING>"
SOLUTION_START = "<SOLUTION>"
SOLUTION_END = "</SOLUTION>"
THINK_START = "<think>"
THINK_END = "</think>"
BOXED = "\\boxed{"
_BRACES = re.compile(r"[{}]")

# Qwen-VL policies sometimes collapse into repeating this config-like token (see the Unsloth
# vision-RL page); the format reward penalises it and the health monitor counts it.
DEGENERATE_TOKEN = "addCriterion"

_THINK = (
    f"First think step by step about the image and write your working between {REASONING_START} and "
    f"{REASONING_END}."
)
_BETWEEN = f"between {SOLUTION_START} and {SOLUTION_END}."
# The numeric instruction (integer, float, or no type given): the seed recipe's text, unchanged, so prompts,
# fingerprints and the demo policy's warm start stay what they were.
INSTRUCTION = f"{_THINK} Then give only the final numeric answer {_BETWEEN}"
ANSWER_INSTRUCTIONS = {
    "choice": f"{_THINK} Then give only the letter of the correct choice, or the choice's text, {_BETWEEN}",
    "expression": f"{_THINK} Then give only the final answer as a mathematical expression (plain or LaTeX, "
    f"e.g. \\frac{{1}}{{2}} or 2\\sqrt{{3}}) {_BETWEEN}",
    "text": f"{_THINK} Then give only the final answer, as short as possible, {_BETWEEN}",
}
# `think`: the answer goes in \\boxed{}, as TRL's accuracy_reward reads it (math-verify, boxed first).
_THINK_FIRST = (f"Start your reply with {THINK_START}, think step by step about the image, and close your "
                f"working with {THINK_END}.")
_BOXED = "in \\boxed{}, e.g. \\boxed{42}."
THINK_INSTRUCTIONS = {
    None: f"{_THINK_FIRST} Then give only the final numeric answer {_BOXED}",
    "choice": f"{_THINK_FIRST} Then give only the letter of the correct choice, or the choice's text, {_BOXED}",
    "expression": f"{_THINK_FIRST} Then give only the final answer as a mathematical expression (LaTeX, e.g. "
    f"\\frac{{1}}{{2}} or 2\\sqrt{{3}}) {_BOXED}",
    "text": f"{_THINK_FIRST} Then give only the final answer, as short as possible, {_BOXED}",
}
TEMPLATE_FIELD = "{question}"  # where a prompt template puts the question (and its choices)
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # choice letters: A is the first choice (grading.choice_equal)


def build_prompt_text(
    question: str,
    *,
    answer_type: str | None = None,
    choices: Sequence[str] | None = None,
    contract: str = "seed",
    template: str | None = None,
) -> str:
    """The user-turn text for one item: the question, the choices for `choice`, then the instruction.

    With a `template` (`data.prompt_template`, as EasyR1's `format_prompt`), the question and its choices
    replace `{question}` in it and vlmrl's instruction is left out: the template says what form to answer in,
    and the rewards still read the `contract`'s.

    No type, `integer` and `float` give the numeric instruction; `choice` lists the choices with their
    letters (unless the question already does, as MathVista's `query` does) and asks for a letter or a
    choice's text; `expression` and `text` say what kind of answer is wanted. The instruction asks for the
    `contract`'s form (`seed`: the tags; `think`: `<think>` working, then `\\boxed{}`).

    >>> print(build_prompt_text("Which angle is largest?", answer_type="choice", choices=["30°", "60°"]))
    ... # doctest: +ELLIPSIS
    Which angle is largest?
    Choices:
    (A) 30°
    (B) 60°
    <BLANKLINE>
    First think step by step ... Then give only the letter of the correct choice, or the choice's text, ...
    >>> build_prompt_text("2+2?", template="{question} Answer in one word.")
    '2+2? Answer in one word.'
    """
    check_contract(contract)
    text = question.strip()
    kind = None if answer_type in (None, "integer", "float") else answer_type
    if kind is not None and kind not in ANSWER_INSTRUCTIONS:
        raise ValueError(f"unknown answer_type {answer_type!r}")
    if kind == "choice" and choices:
        lines = [f"({LETTERS[i]}) {c}" if i < len(LETTERS) else f"- {c}" for i, c in enumerate(choices)]
        if not all(line in text for line in lines):
            text += "\nChoices:\n" + "\n".join(lines)
    if template is not None:
        return template.replace(TEMPLATE_FIELD, text)
    if contract == "think":
        return f"{text}\n\n{THINK_INSTRUCTIONS[kind]}"
    return f"{text}\n\n{INSTRUCTION if kind is None else ANSWER_INSTRUCTIONS[kind]}"


def render_answer(reasoning: str, solution: str, contract: str = "seed") -> str:
    """A completion that satisfies `contract` (used by the SFT warm start, the reward check and tests).

    >>> render_answer("2+2", "4", "think")
    '<think>\\n2+2\\n</think>\\n\\\\boxed{4}'
    """
    check_contract(contract)
    if contract == "think":
        return f"{THINK_START}\n{reasoning.strip()}\n{THINK_END}\n{BOXED}{solution.strip()}}}"
    return f"{REASONING_START}\n{reasoning.strip()}\n{REASONING_END}\n{SOLUTION_START}\n{solution.strip()}\n{SOLUTION_END}"


def extract_answer(text: str, contract: str = "seed") -> str | None:
    """The answer a completion gives under `contract`, stripped, else None.

    `seed`: the text between the one `<SOLUTION>` and the one `</SOLUTION>`. `think`: the content of the one
    `\\boxed{...}` (braces balanced) after the one `</think>`. Linear in the text's length.

    >>> extract_answer("<REASONING>r</REASONING><SOLUTION> 4 </SOLUTION>")
    '4'
    >>> extract_answer("<think>r</think> so \\\\boxed{\\\\frac{1}{2}}.", "think")
    '\\\\frac{1}{2}'
    >>> extract_answer("<think>r</think> \\\\boxed{1} or \\\\boxed{2}", "think") is None  # two answers: neither counts
    True
    """
    check_contract(contract)
    if contract == "think":
        if text.count(THINK_END) != 1:
            return None
        boxed = _boxed_contents(text[text.find(THINK_END) + len(THINK_END) :])
        return boxed[0].strip() if len(boxed) == 1 else None
    if not has_one_pair(text, SOLUTION_START, SOLUTION_END):
        return None
    start = text.find(SOLUTION_START) + len(SOLUTION_START)
    return text[start : text.find(SOLUTION_END)].strip()


def format_checks(text: str, contract: str = "seed") -> tuple[bool, bool]:
    """(the working is well-formed, the answer is well-formed) under `contract`; the format reward adds them.

    `seed`: one `<REASONING>` pair, opening first; one `<SOLUTION>` pair, opening first. `think`: the text
    starts with the one `<think>`, closed by the one `</think>` (TRL's think_format_reward's rule); one
    balanced `\\boxed{}` after it.

    >>> format_checks("<think>r</think>\\n\\\\boxed{4}", "think"), format_checks(" <think>r</think>", "think")
    ((True, True), (False, False))
    """
    check_contract(contract)
    if contract == "think":
        working = text.startswith(THINK_START) and has_one_pair(text, THINK_START, THINK_END)
        return working, extract_answer(text, "think") is not None
    return has_one_pair(text, REASONING_START, REASONING_END), has_one_pair(text, SOLUTION_START, SOLUTION_END)


def has_one_pair(text: str, opening: str, closing: str) -> bool:
    """Exactly one ``opening`` and one ``closing`` tag, in that order (nested or repeated pairs fail)."""
    return text.count(opening) == 1 and text.count(closing) == 1 and text.find(opening) < text.find(closing)


def check_contract(contract: str) -> None:
    """A contract name other than `seed` or `think` is a ValueError: a typo must not zero every reward."""
    if contract not in CONTRACTS:
        raise ValueError(f"unknown contract {contract!r}; use one of {', '.join(CONTRACTS)}")


def _boxed_contents(text: str) -> list[str]:
    """The content of every `\\boxed{...}` in `text`, braces balanced; an unclosed one is not counted."""
    found, start = [], text.find(BOXED)
    while start != -1:
        depth, end = 1, None
        for brace in _BRACES.finditer(text, start + len(BOXED)):  # jumps from brace to brace: linear
            depth += 1 if brace.group() == "{" else -1
            if not depth:
                end = brace.start()
                break
        if end is None:
            break
        found.append(text[start + len(BOXED) : end])
        start = text.find(BOXED, end)
    return found


def completion_text(completion: object) -> str | None:
    """The assistant text of a completion in any form TRL passes to reward functions.

    TRL gives plain strings for standard prompts and ``[{"role": "assistant", "content": ...}]`` for
    conversational ones; content may itself be a list of ``{"type": "text", "text": ...}`` parts.
    Returns None for anything that is not text (the caller scores it 0 and logs it).
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion:
        message = completion[-1]
        if isinstance(message, dict):
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                if all(isinstance(p, str) for p in parts):
                    return "".join(parts)
    return None
