"""`vlmrl bench` with the A/B variants of vlmrl's engine as extra paths: the experiments that lost or tied
(`vlmrl.engine.experimental`, unsupported) and the settings that were switches before they went automatic.

    python benchmarks/engine_variants.py bench --paths plain,vlmrl,vlmrl-merged --steps 2   (one CUDA GPU)

Every option of `vlmrl bench` works the same; `--paths` takes `plain`, `vlmrl`, `unsloth` and the names below.
Committed plans and results name these paths (benchmarks/gpu_*.plan, benchmarks/results/); docs/benchmarks.md has
what each measured. `vlmrl-stacked` and `vlmrl-stacked-kernel` now run exactly what `vlmrl` runs (their settings
became the default) and stay so that the plans that name them still run; so does `vlmrl-nf4-v2` (the nf4
token-step kernel, now the product's on sm_90).
"""

from __future__ import annotations

import functools
import sys

from vlmrl.bench.run import VARIANTS, Variant

FILLED_WINDOW = 128  # the filled-cache window measured: 11 windows over the seed's 1,344 cache positions


def _experiment(**options: object) -> object:
    """`vlmrl.engine.experimental.rollout.apply` with `options`, run after `enable_fast_generation`."""
    from vlmrl.engine.experimental.rollout import apply

    return functools.partial(apply, **options)


def engine_variants() -> dict[str, Variant]:
    """Each variant path: what it changes from the `vlmrl` path."""
    return {
        # the adapter merged into the weights for each rollout (neither stacked projections nor copies then)
        "vlmrl-merged": Variant(fast={"stacked": False, "adapter_copies": False}, after=_experiment(merge=True)),
        # a token step's attention reads only the filled cache positions, in windows of FILLED_WINDOW
        "vlmrl-filled": Variant(after=_experiment(filled_window=FILLED_WINDOW)),
        # bf16 adapter copies for rollouts instead of the stacked projections
        "vlmrl-copies": Variant(fast={"stacked": False}),
        "vlmrl-filled-copies": Variant(fast={"stacked": False}, after=_experiment(filled_window=FILLED_WINDOW)),
        # PEFT's float32 casts of the LoRA inputs kept in the loss pass
        "vlmrl-input-cast": Variant(loss_pass={"adapter_input_cast": True}),
        # token steps attend through SDPA over the whole cache instead of vlmrl's decode kernel
        "vlmrl-sdpa-decode": Variant(after=_experiment(sdpa_decode=True)),
        # the loss pass runs the modules' own RMSNorm, RoPE and SiLU gate instead of Liger's kernels
        "vlmrl-own-kernels": Variant(loss_pass={"kernels": False}),
        "vlmrl-stacked": Variant(),  # the default now
        # dynamo's guards checked until each rollout's token steps are steady
        "vlmrl-guards-once": Variant(after=_experiment(guards_once=True)),
        "vlmrl-stacked-kernel": Variant(),  # the default now
        # the stacked groups' second step as a cuBLAS matmul and a sum instead of one Triton kernel
        "vlmrl-second-cublas": Variant(after=_experiment(second_cublas=True)),
        # a 4-bit base's token steps on bitsandbytes' Linear4bit instead of vlmrl's nf4 kernel, or through the
        # kernel's first design
        "vlmrl-bnb": Variant(after=_experiment(nf4_kernel="off")),
        "vlmrl-nf4-v1": Variant(after=_experiment(nf4_kernel="v1")),
        "vlmrl-nf4-v2": Variant(),  # the default now (on the GPUs where it was measured: nf4.gpu_reason)
        # the product's nf4 kernel with the LoRA branch's second factor and sum folded into its last pass
        # (vlmrl.engine.experimental.nf4_lora); vlmrl-nf4-unfused, its A/B partner in gpu_issue39_next.plan, is the
        # default
        "vlmrl-nf4-folded": Variant(after=_experiment(nf4_kernel="folded")),
        # the same kernel with only the branch's scale and sum in its last pass, both factors as PEFT runs them
        # (vlmrl.engine.experimental.nf4_lora, summed); gpu_issue39_rest.plan times it beside the default
        "vlmrl-nf4-summed": Variant(after=_experiment(nf4_kernel="summed")),
        # the product's nf4 kernel with its settings by rule (nf4.rule_config), without the TUNED_SM90 table
        "vlmrl-nf4-by-rule": Variant(after=_experiment(nf4_kernel="by_rule")),
        "vlmrl-nf4-unfused": Variant(),
    }


def register() -> None:
    """Add the variants to the bench's paths (`vlmrl.bench.run.VARIANTS`)."""
    VARIANTS.update(engine_variants())


def main(argv: list[str] | None = None) -> None:
    """Register the variants, then run vlmrl's command line (`bench ...`) with `argv`."""
    from vlmrl.cli.app import app

    register()
    app(args=sys.argv[1:] if argv is None else argv, prog_name="engine_variants.py")


if __name__ == "__main__":
    main()
