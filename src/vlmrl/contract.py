"""The task contract: the output structure every stage agrees on.

The model sees an image and a question and must answer as

    <REASONING>
    ...free-form working...
    </REASONING>
    <SOLUTION>
    42.5
    </SOLUTION>

Rewards, grading, records and the report all depend on these four tags and on the instruction
text below, so they live here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence

REASONING_START = "<REASONING>"
REASONING_END = "</REASONING>"
SOLUTION_START = "<SOLUTION>"
SOLUTION_END = "</SOLUTION>"

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
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # choice letters: A is the first choice (grading.choice_equal)


def build_prompt_text(
    question: str, *, answer_type: str | None = None, choices: Sequence[str] | None = None
) -> str:
    """The user-turn text for one item: the question, the choices for `choice`, then the instruction.

    No type, `integer` and `float` give the numeric instruction; `choice` lists the choices with their
    letters (unless the question already does, as MathVista's `query` does) and asks for a letter or a
    choice's text; `expression` and `text` say what kind of answer is wanted.

    >>> print(build_prompt_text("Which angle is largest?", answer_type="choice", choices=["30°", "60°"]))
    ... # doctest: +ELLIPSIS
    Which angle is largest?
    Choices:
    (A) 30°
    (B) 60°
    <BLANKLINE>
    First think step by step ... Then give only the letter of the correct choice, or the choice's text, ...
    """
    text = question.strip()
    if answer_type in (None, "integer", "float"):
        return f"{text}\n\n{INSTRUCTION}"
    if answer_type not in ANSWER_INSTRUCTIONS:
        raise ValueError(f"unknown answer_type {answer_type!r}")
    if answer_type == "choice" and choices:
        lines = [f"({LETTERS[i]}) {c}" if i < len(LETTERS) else f"- {c}" for i, c in enumerate(choices)]
        if not all(line in text for line in lines):
            text += "\nChoices:\n" + "\n".join(lines)
    return f"{text}\n\n{ANSWER_INSTRUCTIONS[answer_type]}"


def render_answer(reasoning: str, solution: str) -> str:
    """A completion that satisfies the contract (used by the SFT warm start and by tests)."""
    return f"{REASONING_START}\n{reasoning.strip()}\n{REASONING_END}\n{SOLUTION_START}\n{solution.strip()}\n{SOLUTION_END}"


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
