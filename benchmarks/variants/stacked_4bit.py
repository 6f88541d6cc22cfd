"""Over a bitsandbytes 4-bit base, each LoRA projection's first factor a group of its own: the product stacks the
first factors by shared input there (`vlmrl.engine.rollout.stacked`, one matmul for q/k/v and one for gate/up);
here each projection keeps PEFT's own first-factor matmul, and only the second step is the product's (or, with
`second_inline`, pointwise work). Used by the bench path `vlmrl-4bit-inline`.

(The first factors stacked over a 4-bit base began here as an experiment: it lost 1.33x per token step on an H100
while each token step paid dynamo's guards and the graph trees' input copies, then won 2-4% of decode both ways round
once each rollout's token step was recorded as one graph, and moved into the product: benchmarks/NOTES.md.)

- `first_factors_apart()`: inside the block, `enable_fast_generation` stacks no two projections together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from vlmrl.engine.patch import replaced
from vlmrl.engine.rollout import stacked


@contextlib.contextmanager
def first_factors_apart() -> Iterator[None]:
    """Inside the block, every stacked group holds one projection (no shared-input groups)."""
    with replaced(stacked, "SHARED_INPUT", ()):
        yield
