"""Bench plugins: the A/B variants of vlmrl's engine that lost or tied, outside the product (nothing in `vlmrl`
imports this package; an import-linter contract in pyproject.toml checks that). Unsupported: they may change or go
without notice.

The hook: `vlmrl.bench.run.VARIANTS`, the bench's registry of extra paths (empty in the product). Each entry maps a
path name to a callable `(trainer, settings) -> (rollout record, loss-pass record)` that the bench runs on the built
`GRPOTrainer` in place of `vlmrl.bench.run.vlmrl_engine` (the `vlmrl` path's `enable_fast_generation` +
`enable_loss_pass`). A variant calls the product's set-up itself and changes it from outside: it wraps or replaces
the product's public objects (the `FastGeneration` record, the trainer's rollout contexts, a class the engine
builds), never through a product parameter. `register()` fills the registry with `VARIANTS` below;
benchmarks/engine_variants.py calls it, then runs `vlmrl bench`.

The modules (what each was worth: benchmarks/NOTES.md):
- `rollout`: `apply` (the rollout variants on a set-up trainer: the merge, the filled-cache window, guards checked
  once, one of vlmrl's token-step kernels off, the nf4 designs, CUDA graph trees instead of the recorded token
  step), `attend_filled`, `guards_once`, `unstacked`,
  `input_cast`, and `VariantRecord` (the product's record with `merge` and `guards`).
- `merge`: the LoRA adapter merged into the base weights for each rollout, restored bit for bit afterwards
  (`RolloutMerge`, `rollout_merge`); faster decoding, but bf16 rounding drops small adapter deltas.
- `nf4_v1`: the first design of the nf4 token-step kernel (`nf4_matmul_v1`), and `nf4_decode_with(model, matmul)`.
- `nf4_lora`: a 4-bit base's LoRA branch folded into the product nf4 kernel's last pass (or only its sum).
- `nf4_launch`: the nf4 kernel's launch with another tile kernel, or a LoRA branch in its split sum.
- `stacked_4bit`: over a 4-bit base, each projection's first factor a group of its own (`first_factors_apart`).
- `second_inline`: the stacked groups' second step as pointwise products inductor may fold into its neighbours.
- `nf4_lookups`: the nf4 tile loop with other table lookups, behind `nf4_pairs` (one lookup a byte in a table of
  weight pairs), `nf4_loads` (the product's kernel with table loads, not warp shuffles) and `nf4_bytes` (the product's
  loop before it read 32-bit words).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FILLED_WINDOW = 128  # the filled-cache window measured: 11 windows over the seed's 1,344 cache positions


@dataclass(frozen=True)
class Variant:
    """One variant path: the `vlmrl` path's set-up, then `rollout.apply(**rollout)` on its rollout record; with
    `stacked` False nothing is stacked (the product's adapter copies then), with `apart` each projection is a
    stacked group of its own (`stacked_4bit`: over a 4-bit base, PEFT's first factors as they are), with
    `input_cast` PEFT's LoRA input casts stay in the loss pass, and `loss_pass` passes the product's own
    `enable_loss_pass` options."""

    rollout: dict = field(default_factory=dict)
    stacked: bool = True
    apart: bool = False
    input_cast: bool = False
    loss_pass: dict = field(default_factory=dict)

    def __call__(self, trainer: Any, settings: Any) -> tuple[Any, Any]:
        import contextlib

        from vlmrl.engine.loss.loss_pass import enable_loss_pass
        from vlmrl.engine.rollout.fast import enable_fast_generation

        from . import rollout, stacked_4bit

        if not self.stacked:
            setup = rollout.unstacked()
        elif self.apart:
            setup = stacked_4bit.first_factors_apart()
        else:
            setup = contextlib.nullcontext()
        with setup:
            fast = enable_fast_generation(trainer, bucket=settings.prompt_bucket)
        if self.rollout:
            fast = rollout.apply(trainer, fast, **self.rollout)
        loss_pass = enable_loss_pass(trainer, **self.loss_pass)
        if self.input_cast:
            loss_pass = rollout.input_cast(trainer, loss_pass)
        return fast, loss_pass


VARIANTS: dict[str, Variant] = {
    # the adapter merged into the weights for each rollout (neither stacked projections nor copies then)
    "vlmrl-merged": Variant(stacked=False, rollout={"merge": True}),
    # a token step's attention reads only the filled cache positions, in windows of FILLED_WINDOW
    "vlmrl-filled": Variant(rollout={"filled_window": FILLED_WINDOW}),
    # bf16 adapter copies for rollouts instead of the stacked projections (over a 4-bit base: PEFT's own branch for
    # each projection, over copies only where the adapters are float32, as before the first factors were stacked)
    "vlmrl-copies": Variant(stacked=False),
    "vlmrl-filled-copies": Variant(stacked=False, rollout={"filled_window": FILLED_WINDOW}),
    # PEFT's float32 casts of the LoRA inputs kept in the loss pass
    "vlmrl-input-cast": Variant(input_cast=True),
    # token steps attend through SDPA over the whole cache instead of vlmrl's decode kernel
    "vlmrl-sdpa-decode": Variant(rollout={"sdpa_decode": True}),
    # the loss pass runs the modules' own RMSNorm, RoPE and SiLU gate instead of Liger's kernels
    "vlmrl-own-kernels": Variant(loss_pass={"kernels": False}),
    "vlmrl-stacked": Variant(),  # the default now
    # dynamo's guards checked until each rollout's token steps are steady (over CUDA graph trees: a recorded token
    # step checks none)
    "vlmrl-guards-once": Variant(rollout={"guards_once": True, "graph_trees": True}),
    # token steps launched by torch.compile's CUDA graph trees, as before each rollout's step was recorded as one
    # CUDA graph (the product's step_graph), over a 4-bit base with PEFT's own LoRA branch, as then
    "vlmrl-graph-trees": Variant(rollout={"graph_trees": True}),
    "vlmrl-step-graph": Variant(),  # the default now, where it applies
    "vlmrl-step-graph-anywhere": Variant(),  # the default now, bf16 included
    "vlmrl-stacked-kernel": Variant(),  # the default now
    # the stacked groups' second step as a cuBLAS matmul and a sum instead of one Triton kernel
    "vlmrl-second-cublas": Variant(rollout={"second_cublas": True}),
    # a 4-bit base's token steps on bitsandbytes' Linear4bit instead of vlmrl's nf4 kernel, or through the
    # kernel's first design (the rest of the set-up as the product's over the kernel: the token steps recorded, the
    # first factors stacked; the product itself keeps neither where bitsandbytes runs its token steps)
    "vlmrl-bnb": Variant(rollout={"nf4_kernel": "off"}),
    "vlmrl-nf4-v1": Variant(rollout={"nf4_kernel": "v1"}),
    "vlmrl-nf4-v2": Variant(),  # the default now (on the GPUs where it was measured: nf4.gpu_reason)
    # the product's nf4 kernel with the LoRA branch's second factor and sum folded into its last pass
    # (nf4_lora); vlmrl-nf4-unfused, its A/B partner in gpu_issue39_next.plan, was the default then
    # (all three over PEFT's own branch, nothing stacked: nf4_lora replaces the LoRA layers' forwards, which
    # the stacked groups would replace too)
    "vlmrl-nf4-folded": Variant(stacked=False, rollout={"nf4_kernel": "folded"}),
    # the same kernel with only the branch's scale and sum in its last pass, both factors as PEFT runs them
    # (nf4_lora, summed); gpu_issue39_rest.plan times it beside the default
    "vlmrl-nf4-summed": Variant(stacked=False, rollout={"nf4_kernel": "summed"}),
    # the product's nf4 kernel with its settings by rule (nf4_settings.rule_config), without the TUNED_SM90 table
    "vlmrl-nf4-by-rule": Variant(rollout={"nf4_kernel": "by_rule"}),
    # the product's nf4 kernel with its table lookups as loads, as before they became warp shuffles, and its K
    # splits summed by a second kernel (nf4_loads)
    "vlmrl-nf4-loads": Variant(rollout={"nf4_kernel": "loads"}),
    # ... with its lookups by warp shuffle, its K splits summed by a second kernel, as before the tile kernel's last
    # split summed them (nf4_loads)
    "vlmrl-nf4-split-sum": Variant(rollout={"nf4_kernel": "split_sum"}),
    # ... with its packed bytes decoded a byte at a time, as before it read 32-bit words, its K splits summed by a
    # second kernel: compare with vlmrl-nf4-split-sum (nf4_bytes)
    "vlmrl-nf4-bytes": Variant(rollout={"nf4_kernel": "bytes"}),
    "vlmrl-nf4-unfused": Variant(stacked=False),
    # rows that have ended keep reading their whole cache at token steps (the product narrows their mask)
    "vlmrl-finished-read": Variant(rollout={"finished_read": True}),
    # over a 4-bit base, the LoRA first factors stacked by shared input and each member's second step one kernel:
    # the default now where token steps are recorded (its A/B partner, PEFT's own branch per projection: vlmrl-copies)
    "vlmrl-4bit-stacked": Variant(),
    # the stacked groups' second step as pointwise products that inductor may fold into the kernels around it
    # (second_inline), in bf16 and over a 4-bit base with the first factors stacked
    "vlmrl-second-inline": Variant(rollout={"second_inline": True}),
    "vlmrl-4bit-stacked-inline": Variant(rollout={"second_inline": True}),
    # over a 4-bit base, each projection's first factor apart (as PEFT runs it), the second step pointwise
    "vlmrl-4bit-inline": Variant(apart=True, rollout={"second_inline": True}),
    # over a 4-bit base, each projection's LoRA branch apart from its nf4 kernel (the group's first-factor matmul and
    # the member's second-step kernel), as before the product ran both in one launch (nf4_branch)
    "vlmrl-branch-apart": Variant(rollout={"branch_apart": True}),
    # each stacked group's token step as cuBLAS's matmul, then the second-step kernel, as before the product ran both
    # in one kernel (group_step)
    "vlmrl-group-apart": Variant(rollout={"group_apart": True}),
    # inductor's combo kernels (independent small kernels of the token step launched as one) while rollouts compile
    "vlmrl-combo-kernels": Variant(rollout={"inductor": {"combo_kernels": True}}),
}


def register(registry: dict[str, Callable[[Any, Any], tuple[Any, Any]]] | None = None) -> None:
    """Add `VARIANTS` to the bench's paths (`vlmrl.bench.run.VARIANTS`, unless another `registry` is given)."""
    if registry is None:
        from vlmrl.bench.run import VARIANTS as registry
    registry.update(VARIANTS)
