"""Rollouts under FSDP2: the root unit gathered, and FSDP initialised from the root, around each of TRL's `generate`
calls, so a vision-language model with a LoRA adapter can generate while sharded.

Why: TRL generates through `PeftModel.generate`, which calls the inner model directly, so the root unit's forward
hooks never run. Under accelerate's FSDP2 the root holds what no block, the embeddings or the tail unit took: for
Qwen3-VL the vision tower's patch and position embeddings and mergers. Left sharded, the first rollout fails
("got mixed torch.Tensor and DTensor"); and FSDP2's lazy initialisation, started by whichever unit runs first,
refuses the tail unit (final norm and LM head: "FSDP requires a single root module"). Blocks still gather and free
themselves one by one at every token step; only the root's few parameters stay gathered for the rollout. Checked
on the CPU with accelerate's own FSDP2 wrapping (tests/test_fsdp_rollout.py); not yet on GPUs.
Left out: FSDP1 (TRL's `summon_full_params` covers it) and DeepSpeed ZeRO-3 (TRL gathers the whole model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def root_gathered(model: Any) -> Iterator[None]:
    """Inside the block, an FSDP2 root's own parameters are gathered (and FSDP initialised from it); no-op for a
    model that is not an FSDP2 module."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    state = model._get_fsdp_state()
    state._lazy_init()  # from the root, as its forward would; a no-op once a training step has run
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def gather_root_in_rollouts(trainer: Any) -> bool:
    """Wrap `trainer`'s rollout call in `root_gathered(trainer.model_wrapped)` when accelerate will shard it with
    FSDP; True when it did. Call it before `enable_fast_generation`, whose wrapper then runs outside this one."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return False
    inner = trainer._generate_single_turn

    def generate(*args: Any, **kwargs: Any) -> Any:
        with root_gathered(trainer.model_wrapped):  # the FSDP-wrapped model, once training has prepared it
            return inner(*args, **kwargs)

    trainer._generate_single_turn = generate
    return True
