"""The product's nf4 token-step kernel as it was before it decoded the packed bytes a 32-bit word at a time: a byte
at a time, each byte unpacked and its two nibbles shifted and masked apart before their lookups. The A/B partner of
the product's word loop (`benchmarks/nf4_matmul.py --kernels v2,shuffle,bytes`: "shuffle" is the product's loop with
the same split sum; bench path `vlmrl-nf4-bytes` against `vlmrl-nf4-split-sum`).

Why the product reads words: its tile loop is bound by its own instructions (benchmarks/NOTES.md, "What the nf4
kernel waits on"). Built for sm_90 this loop spends about 2.5 instructions a weight taking the bytes apart before any
lookup (PRMT, a 16-bit mask, SHF, SGXT, LOP3). A warp shuffle reads its source lane from the index's low 5 bits only,
and every lane l holds table entry l mod 16, so the word shifted right by a nibble's position is already a valid
index: one shift and one shuffle a weight. The values and their order are the same, so the outputs are the same bit
for bit (`tests/test_variants.py`, in the interpreter and on a GPU).

Public: `nf4_matmul_bytes` (the arguments and values of `nf4.nf4_matmul`; lookups by warp shuffle forced on,
unchecked). The tile kernel is `nf4_lookups.byte_loop`; settings, launch and split sum (a second kernel) the
product's (`nf4_lookups`).
"""

from __future__ import annotations

from . import nf4_lookups

nf4_matmul_bytes = nf4_lookups.lookup_matmul("bytes")
