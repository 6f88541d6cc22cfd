"""Rows that have finished stop reading their KV cache at token steps.

transformers' `generate` keeps a row that has met an end-of-sequence token in the batch until every row has (it
feeds it padding), and each token step still runs that row's attention over every cache position it has
written, though what the step computes for the row is thrown away: its next token is replaced by padding. With
completions of unequal length, which is every real rollout, the finished rows' cache is most of what a late
token step's attention reads.

`finished_rows_read_one_block(model)`: inside the block, each token step's attention mask lets a row whose last
token is one of the end-of-sequence ids `generate` stops on attend to its own new position only. The decode
attention kernel (`vlmrl.engine.rollout.decode_attention`) skips the cache blocks nothing attends to, so it reads
one block of that row's cache instead of all of it. Rows still generating get the mask they had, so their
tokens and log-probabilities are unchanged; only what the step computes for finished rows, which `generate`
discards, changes. The mask keeps its shape, so a compiled step does not recompile. `vlmrl.engine.rollout.fast`
turns it on in rollouts wherever the decode kernel runs.

Limits: a 4-D boolean mask with one row per sequence and one query token (the static-cache token steps the fast
path sets up); any other mask (a dict of masks for sliding-window layers, a float mask, one shared by the batch)
is passed on as it is. Rows stopped by another criterion (stop strings) keep reading their cache. Wraps two of
transformers' generation internals (5.x): `_get_stopping_criteria`, for the ids each call stops on, and
`prepare_inputs_for_generation`, which builds each step's mask on the host before the step runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from vlmrl.engine.patch import replaced


class FinishedRows:
    """One `generate` call's finished rows, and the token-step masks that keep them off their cache.

    >>> rows = FinishedRows(torch.tensor([2]))
    >>> mask = torch.ones(2, 1, 1, 4, dtype=torch.bool)
    >>> rows.mask(torch.tensor([[5, 2], [5, 7]]), mask)[:, 0, 0].int().tolist()  # row 0 ended: its own position
    [[0, 1, 0, 0], [1, 1, 1, 1]]
    """

    def __init__(self, eos: torch.Tensor):
        self.eos = eos
        self.done: torch.Tensor | None = None  # [B] bool, on the device: stays set once a row has ended
        self._positions: torch.Tensor | None = None

    def mask(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The mask of the token step that follows `input_ids` (its last token is the one just sampled)."""
        device = mask.device
        if self.eos.device != device:
            self.eos = self.eos.to(device)
        ended = torch.isin(input_ids[:, -1].to(device), self.eos)
        self.done = ended if self.done is None else self.done | ended
        length = mask.shape[-1]
        if self._positions is None or self._positions.shape[0] != length or self._positions.device != device:
            self._positions = torch.arange(length, device=device)
        own = (self._positions == input_ids.shape[1] - 1).view(1, 1, 1, length)  # the step's own cache position
        return torch.where(self.done.view(-1, 1, 1, 1), own, mask)


def token_step_mask(mask: Any, input_ids: torch.Tensor) -> bool:
    """True for a mask this can narrow: [B, 1, 1, positions] boolean, one row per sequence, covering the step's
    own position."""
    return (
        isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[0] == input_ids.shape[0]
        and mask.shape[1] == mask.shape[2] == 1
        and mask.shape[-1] >= input_ids.shape[1]
    )


def _eos_ids(criteria: Any) -> torch.Tensor | None:
    from transformers.generation.stopping_criteria import EosTokenCriteria

    found = [c.eos_token_id for c in criteria if isinstance(c, EosTokenCriteria)]
    return torch.cat([torch.as_tensor(e).reshape(-1) for e in found]) if found else None


@contextlib.contextmanager
def finished_rows_read_one_block(model: Any) -> Iterator[None]:
    """Inside the block, `model.generate`'s token steps give rows that have ended their own position only to
    attend to (see the module's docstring). Nothing changes where transformers has no `_get_stopping_criteria`."""
    from vlmrl.engine.rollout.attention import base_model

    base = base_model(model)
    stopping = getattr(base, "_get_stopping_criteria", None)
    if stopping is None:
        yield
        return
    prepare_inputs = base.prepare_inputs_for_generation
    call: dict[str, FinishedRows | None] = {"rows": None}

    def get_stopping_criteria(*args: Any, **kwargs: Any) -> Any:
        criteria = stopping(*args, **kwargs)  # once per generate call, before its first step
        eos = _eos_ids(criteria)
        call["rows"] = FinishedRows(eos) if eos is not None and eos.numel() else None
        return criteria

    def prepare(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        inputs = prepare_inputs(input_ids, *args, **kwargs)
        rows = call["rows"]
        mask = inputs.get("attention_mask")
        if rows is not None and token_step_mask(mask, input_ids):
            inputs["attention_mask"] = rows.mask(input_ids, mask)
        return inputs

    with replaced(base, "_get_stopping_criteria", get_stopping_criteria), \
            replaced(base, "prepare_inputs_for_generation", prepare):
        yield
