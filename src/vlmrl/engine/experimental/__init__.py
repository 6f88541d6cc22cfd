"""Experiments on vlmrl's engine: nothing here is supported. It may change or go without notice, and stable code
never imports it (an import-linter contract in pyproject.toml checks that); benchmarks/ scripts do.

What is here, each an A/B variant that lost or tied against the product path (docs/benchmarks.md has the runs):
- `merge`: the LoRA adapter merged into the base weights for each rollout, restored bit for bit afterwards
  (`RolloutMerge`, `rollout_merge`); faster decoding, but bf16 rounding drops small adapter deltas.
- `rollout`: `attend_filled` (a token step's attention reads only the filled cache positions, in windows),
  `guards_once` (dynamo's guards checked only until a `generate` call's token steps are steady), and `apply`,
  which adds these (or turns one of vlmrl's kernels off) on a trainer that `enable_fast_generation` set up.
  `benchmarks/engine_variants.py` turns them into `vlmrl bench` paths.
- `nf4_v1`: the first design of the nf4 token-step kernel (`nf4_matmul_v1`): the same values as the product's
  (`vlmrl.engine.rollout.nf4`, whose device helpers it calls); at one pipeline stage within about 10% of the
  product's per projection on an H200, slower on the large ones, and never measured in a rollout at that setting.
- `nf4_lora`: a 4-bit base's LoRA branch (second factor, scale, sum) folded into the product nf4 kernel's last
  pass; the same values as PEFT's ops up to summation order, and slower than them on an H200.

Importing this package warns once (set VLMRL_EXPERIMENTAL_SILENCE=1 to silence it), like TRL's trl.experimental.
"""

from __future__ import annotations

import os
import warnings

if not os.environ.get("VLMRL_EXPERIMENTAL_SILENCE"):
    warnings.warn("vlmrl.engine.experimental is unsupported: it may change or go without notice "
                  "(VLMRL_EXPERIMENTAL_SILENCE=1 silences this warning).", UserWarning, stacklevel=2)
