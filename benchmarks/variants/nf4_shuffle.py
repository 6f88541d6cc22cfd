"""An nf4 token-step kernel whose table lookups are warp shuffles, not loads: an experiment beside the product's
kernel (`vlmrl.engine.rollout.nf4`), for `benchmarks/nf4_matmul.py --kernels v2,shuffle`.

Why: the product's tile loop is bound by its own instructions (benchmarks/NOTES.md, "What the nf4 kernel waits
on"), and a third of them are its table lookups: each nibble's lookup is a global load with its own 64-bit
address (LEA, LEA.HI.X, LDG). Here every thread holds, once, the table value of its lane (lane l holds entry
l mod 16), and each lookup is one `shfl.sync.idx` that reads the value held by the lane whose number is the code:
no address, no memory. The values are the table's own float32 values, so where the shuffles read what they
should, the outputs are the product kernel's bit for bit. The shuffles are inline PTX, so Triton's CPU interpreter cannot run them (it runs the product's loads);
only a GPU checks the values (`nf4_matmul.py`'s numerics table) and the time. Built offline for sm_90,
`python benchmarks/nf4_sass.py --kernel shuffle` counts the loop.

Public: `nf4_matmul_shuffle` (the arguments and values of `nf4.nf4_matmul`). The tile kernel is the product's
`nf4_tiles` with its two lookups replaced (`nf4_lookups`: the same settings, launch and split sum).
"""

from __future__ import annotations

from vlmrl.engine.rollout import nf4

from . import nf4_lookups

nf4_matmul_shuffle = nf4_lookups.lookup_matmul("shuffle")
_config = nf4._config  # the product's settings for the shape (its tile loop's shape is the product's)
