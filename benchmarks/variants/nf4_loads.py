"""The product's nf4 token-step kernel with its table lookups as loads, as it was before they became warp shuffles,
and a split K summed by a second kernel, as before the last split summed it in the tile kernel: the A/B partners of
the product (`benchmarks/nf4_matmul.py --kernels v2,shuffle,loads`, bench paths `vlmrl-nf4-split-sum`,
`vlmrl-nf4-loads`).

Why the product shuffles: its tile loop is bound by its own instructions (benchmarks/NOTES.md, "What the nf4 kernel
waits on"), and a third of them were its table lookups, each nibble's a global load with its own 64-bit address
(LEA, LEA.HI.X, LDG). With shuffles every thread holds, once, the table value of its lane and each lookup is one
`shfl.sync.idx`; the values are the table's own, so the outputs are the same bit for bit (`nf4.shuffles_hold`
checks that on each setting's first launch).

Public: `nf4_matmul_loads` (the arguments and values of `nf4.nf4_matmul`), `nf4_matmul_shuffle` (the shuffles
forced on, unchecked). Both run the product's kernel and settings, their splits summed by the second kernel
(`nf4_lookups`).
"""

from __future__ import annotations

from . import nf4_lookups

nf4_matmul_loads = nf4_lookups.lookup_matmul("loads")
nf4_matmul_shuffle = nf4_lookups.lookup_matmul("shuffle")
