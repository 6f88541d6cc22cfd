"""Each token step gets only its own tokens' entries of the per-token inputs (token type ids).

transformers before 5.23 grows `mm_token_type_ids` by a column at every token and hands a token step the whole of
it. A compiled step then sees a new shape at every token: dynamo recompiles until its recompile limit, and the
rest of the rollout decodes eagerly. Later versions cut it themselves (this then changes nothing). At a token step
the model reads it only to tell whether it is given image tokens, which these columns are not.

Public: `PER_TOKEN_INPUTS`, `step_token_inputs(model)` (a context manager; rollouts and compiled evaluation run
inside it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from vlmrl.engine.patch import replaced

# The inputs that pair with each token of `input_ids`: a token step needs only its own tokens' entries.
PER_TOKEN_INPUTS = ("token_type_ids", "mm_token_type_ids", "moe_mm_token_type_ids")


@contextlib.contextmanager
def step_token_inputs(model: Any) -> Iterator[None]:
    """Inside the block, the per-token inputs a step gets (`PER_TOKEN_INPUTS`) are cut to that step's tokens.
    Nothing changes for a model that is not a transformers generator."""
    from vlmrl.engine.rollout.attention import base_model

    base = base_model(model)
    prepare_inputs = getattr(base, "prepare_inputs_for_generation", None)
    if prepare_inputs is None:
        yield
        return

    def prepare(*args: Any, **kwargs: Any) -> Any:
        inputs = prepare_inputs(*args, **kwargs)
        ids = inputs.get("input_ids")
        for name in PER_TOKEN_INPUTS if ids is not None else ():
            value = inputs.get(name)
            if isinstance(value, torch.Tensor) and value.shape[-1] > ids.shape[-1]:
                # a fresh buffer: a one-row slice counts as contiguous but keeps the growing row stride
                inputs[name] = value[..., -ids.shape[-1]:].clone(memory_format=torch.contiguous_format)
        return inputs

    with replaced(base, "prepare_inputs_for_generation", prepare):
        yield
