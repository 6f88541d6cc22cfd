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

REASONING_START = "<REASONING>"
REASONING_END = "</REASONING>"
SOLUTION_START = "<SOLUTION>"
SOLUTION_END = "</SOLUTION>"

# Qwen-VL policies sometimes collapse into repeating this config-like token (see the Unsloth
# vision-RL page); the format reward penalises it and the health monitor counts it.
DEGENERATE_TOKEN = "addCriterion"

INSTRUCTION = (
    f"First think step by step about the image and write your working between {REASONING_START} and "
    f"{REASONING_END}. Then give only the final numeric answer between {SOLUTION_START} and "
    f"{SOLUTION_END}."
)


def build_prompt_text(question: str) -> str:
    """The user-turn text for one item: the question, then the instruction about the structure."""
    return f"{question.strip()}\n\n{INSTRUCTION}"


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
