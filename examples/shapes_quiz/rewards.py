"""This example's own reward functions, named in config.yaml as `rewards.py:<name>`.

Each has TRL's reward signature: `fn(prompts, completions, **kwargs) -> list[float | None]`, one value per
completion. `kwargs` holds every dataset column of each completion's item as a list aligned with
`completions` (`answer`, `answer_type`, `choices`, ... and this dataset's extra column `level`). Return None
for a completion the reward does not apply to; TRL then leaves it out of that reward.
"""

from __future__ import annotations


def _text(completion) -> str:
    # TRL passes plain strings, or for conversational data [{"role": "assistant", "content": "..."}]
    if isinstance(completion, list):
        return " ".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def brevity(prompts, completions, **kwargs) -> list[float]:
    """0 up to 24 words, then -0.05 per extra word, down to -1: keep the reasoning short."""
    return [max(-1.0, -0.05 * max(0, len(_text(c).split()) - 24)) for c in completions]


def hard_bonus(prompts, completions, level, answer, **kwargs) -> list[float | None]:
    """+1 when a level-3 question's gold answer appears in the completion; None (not scored) below level 3."""
    return [
        (1.0 if str(gold) in _text(c) else 0.0) if lvl == 3 else None
        for c, lvl, gold in zip(completions, level, answer)
    ]
