"""An nf4 token-step kernel that decodes the packed bytes a 32-bit word at a time, each nibble looked up straight
from the shifted word: an experiment beside the product's kernel (`vlmrl.engine.rollout.nf4`), for
`benchmarks/nf4_matmul.py --kernels v2,words` and the bench path `vlmrl-nf4-words`.

Why: the product's tile loop is bound by its own instructions (benchmarks/NOTES.md, "What the nf4 kernel waits
on"). Built for sm_90 it spends about 2.5 instructions a weight taking the bytes apart before any lookup: each byte
unpacked from its word (PRMT, a 16-bit mask), its high nibble shifted and extracted (SHF, SGXT), its low one masked
(LOP3). A warp shuffle reads its source lane from the index's low 5 bits only, and every lane l holds table entry
l mod 16, so the word shifted right by the nibble's position is already a valid index: one shift and one shuffle a
weight. The values are the table's own and the weights reach the tensor cores in the same order, so the outputs are
the product's (with its split K summed by the second kernel) bit for bit; in the interpreter the lookups are loads
of the masked nibble.

Public: `nf4_matmul_words` (the arguments and values of `nf4.nf4_matmul`; lookups by warp shuffle forced on, not
checked against the loads as the product's launch checks them: the numerics of `nf4_matmul.py` and the bench's
mismatch columns judge). The tile kernel is `nf4_lookups.words_kernel`; settings, launch and split sum the
product's (`nf4_lookups`).
"""

from __future__ import annotations

from vlmrl.engine.rollout import nf4

from . import nf4_lookups

nf4_matmul_words = nf4_lookups.lookup_matmul("words")
_config = nf4._config  # the product's settings for the shape
