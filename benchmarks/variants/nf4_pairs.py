"""An nf4 token-step kernel that looks each packed byte up once: a 256-entry table of weight pairs, not two lookups
of a nibble each. An experiment beside the product's kernel (`vlmrl.engine.rollout.nf4`), for `benchmarks/nf4_matmul.py
--kernels v2,pairs`.

Why: under Nsight Compute the product's tile loop is bound by its own instructions (benchmarks/NOTES.md, "What the
nf4 kernel waits on"): each nibble's lookup is a global load with its own 64-bit address (LEA, LEA.HI.X, LDG) after
a shift or mask. Here the byte itself is the index into 256 (first, second) float32 pairs, one 8-byte load a byte;
the pair's halves are the two weights' table values, exactly those of the 16-value table, so the values are the
product's (bitsandbytes' dequantize-then-matmul up to summation order). Built offline for sm_90 the loop takes
fewer instructions per weight (benchmarks/NOTES.md has the counts). What it may cost instead: a warp's 32 lookups now land on up to 16 of the
2 KB table's cache lines, where the 16-value table fits one, so L1 serves each load in several passes; only a GPU
run says which wins.

Public: `nf4_matmul_pairs` (the arguments and values of `nf4.nf4_matmul`), `pair_table(lut)`. The tile kernel is the
product's loop as it was before it read words, with its two lookups replaced (`nf4_lookups.byte_loop` with `PAIRS`:
the product's settings, launch and split sum).
"""

from __future__ import annotations

import torch

from . import nf4_lookups

_tables: dict[tuple, torch.Tensor] = {}  # (device, the table's address) -> its pair table, made once


def pair_table(lut: torch.Tensor) -> torch.Tensor:
    """float32 [16 + 512]: the 16-value table, then for each byte b the pair (lut[b >> 4], lut[b & 15]), the weights
    of its high nibble (first in a row) and its low one. Made once per table (a CUDA graph replays its address)."""
    key = (str(lut.device), lut.data_ptr())
    if key not in _tables:
        b = torch.arange(256, device=lut.device)
        pairs = torch.stack([lut[b >> 4], lut[b & 15]], dim=1).float().reshape(-1)
        _tables[key] = torch.cat([lut.float(), pairs])
    return _tables[key]


# the extended table's first 16 values are the table itself, so the reference (where Triton cannot run) reads it
nf4_matmul_pairs = nf4_lookups.lookup_matmul("pairs", pair_table)
