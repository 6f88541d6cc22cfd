"""This example's own reward, beside the two from `trl.rewards`: named in config.yaml as `rewards.py:varied_tokens`.

It takes only `completion_ids` (TRL hands every reward `prompts`, `completions`, `completion_ids`, each dataset
column and its hooks, all by keyword; a reward names what it reads and keeps `**kwargs` for the rest).
"""

from __future__ import annotations


def varied_tokens(completion_ids, **kwargs) -> list[float]:
    """The share of a completion's tokens that are distinct: 1.0 without repeats, lower for a looping policy.

    >>> varied_tokens([[1, 2, 3, 4], [7, 7, 7, 7], []])
    [1.0, 0.25, 0.0]
    """
    return [len(set(ids)) / len(ids) if ids else 0.0 for ids in completion_ids]
