"""The bench's ragged workload: completions that end at different lengths, as real ones do.

The forced workload (`min_new_tokens` = the cap) makes every row of a rollout as long as the cap. Real
completions end early, and a `contract: think` policy leaves a long tail at the cap. With `--ragged-median M`
each completion's length is drawn from a log-normal whose median is M and whose top tenth is at the cap
(`--completion`), clipped to [1, cap]; `ForcedLengths` then suppresses the end-of-sequence tokens before a row's
length and forces one at it. The draws depend only on the seed and the number of rows, so every rollout of every
path generates the same lengths and the paths' steps stay comparable (the rows of one rollout differ; rollouts
do not).

Public: `draw_lengths`, `ForcedLengths`, `force_lengths` (installs it on a GRPOTrainer's rollouts, after the
sampler's log-prob recorder, so the rollout mismatch compares the model's own distribution: a forced token is
recorded at its log-probability under the model, as the loss pass computes it).
Left out: the figures over these lengths (`vlmrl.bench.summary`, `vlmrl.bench.floors`).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np
import torch

from vlmrl.engine.rollout.sampling import appended_processor

TAIL = 0.1  # the fraction of completions drawn at or past the cap


def sigma_for(median: int, cap: int) -> float:
    """The log-normal's sigma that puts `TAIL` of the draws at or above `cap`, given its median.

    >>> round(sigma_for(600, 4096), 3)
    1.499
    """
    return math.log(cap / median) / NormalDist().inv_cdf(1 - TAIL)


def draw_lengths(n: int, median: int, cap: int, seed: int = 0) -> list[int]:
    """`n` completion lengths: log-normal (median `median`, a tenth at `cap`), rounded and clipped to [1, cap];
    the same for the same (n, median, cap, seed)."""
    if not 1 <= median < cap:
        raise ValueError(f"the median ({median}) must be at least 1 and below the cap ({cap})")
    rng = np.random.default_rng(seed)
    draws = np.exp(rng.normal(math.log(median), sigma_for(median, cap), size=n))
    return np.clip(np.rint(draws), 1, cap).astype(int).tolist()


class ForcedLengths:
    """A logits processor ending row i at exactly `lengths[i]` generated tokens (the last one an end token).

    Before a row's length its end tokens are suppressed; at it, the first end token is the only choice. After it
    the row is finished and `generate` pads it.

    >>> p = ForcedLengths([1, 3], eos_ids=[0])
    >>> scores = torch.zeros(2, 4)
    >>> out = p(torch.ones(2, 5, dtype=torch.long), scores.clone())  # the first generated token
    >>> out[0].tolist(), out[1, 0].item()
    ([0.0, -inf, -inf, -inf], -inf)
    """

    def __init__(self, lengths: list[int], eos_ids: list[int]):
        self.lengths = torch.tensor(lengths)
        self.eos_ids = torch.tensor(eos_ids)
        self.prompt_length: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        made = input_ids.shape[1] - self.prompt_length  # tokens generated before this one
        lengths = self.lengths.to(scores.device)
        eos = self.eos_ids.to(scores.device)
        scores = scores.clone()
        early = (lengths > made + 1)[:, None]
        scores[:, eos] = torch.where(early, torch.full_like(scores[:, eos], -math.inf), scores[:, eos])
        only_eos = torch.full_like(scores, -math.inf)
        only_eos[:, eos[0]] = 0.0
        return torch.where((lengths == made + 1)[:, None], only_eos, scores)


def force_lengths(trainer: Any, median: int, cap: int, seed: int = 0) -> None:
    """Make each of `trainer`'s rollouts end its rows at drawn lengths. Install it after
    `vlmrl.engine.rollout.sampling.enable_sampler_logprobs` (the mismatch's), so that the recorder sees the logits
    before the forcing."""
    inner = trainer._generate_single_turn

    def generate(*args: Any, **kwargs: Any) -> Any:
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        with _forced(model, median, cap, seed, list(trainer.eos_token_ids)):
            return inner(*args, **kwargs)

    trainer._generate_single_turn = generate


def _forced(model: Any, median: int, cap: int, seed: int, eos_ids: list[int]) -> Any:
    """For the block, `model.generate` also runs `ForcedLengths` (after any processors it is given)."""

    def make(args: tuple, kwargs: dict) -> ForcedLengths:
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
        return ForcedLengths(draw_lengths(ids.shape[0], median, cap, seed), eos_ids)

    return appended_processor(model, make)
