"""`vlmrl bench` with the A/B variants of vlmrl's engine as extra paths: the experiments that lost or tied and the
settings that were switches before they went automatic, all bench plugins in benchmarks/variants/ (unsupported).

    python benchmarks/engine_variants.py bench --paths plain,vlmrl,vlmrl-merged --steps 2   (one CUDA GPU)

Every option of `vlmrl bench` works the same; `--paths` takes `plain`, `vlmrl`, `unsloth` and the names in
`variants.VARIANTS`. Committed plans and results name these paths (benchmarks/gpu_*.plan, benchmarks/results/);
benchmarks/NOTES.md has what each measured. `vlmrl-stacked` and `vlmrl-stacked-kernel` now run exactly what `vlmrl`
runs (their settings became the default) and stay so that the plans that name them still run; so does `vlmrl-nf4-v2`
(the nf4 token-step kernel, now the product's on sm_90).
"""

from __future__ import annotations

import sys

import variants


def register() -> None:
    """Add the variants to the bench's paths (`vlmrl.bench.run.VARIANTS`)."""
    variants.register()


def main(argv: list[str] | None = None) -> None:
    """Register the variants, then run vlmrl's command line (`bench ...`) with `argv`."""
    from vlmrl.cli.app import app

    register()
    app(args=sys.argv[1:] if argv is None else argv, prog_name="engine_variants.py")


if __name__ == "__main__":
    main()
