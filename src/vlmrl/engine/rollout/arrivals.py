"""Arrival counters for the split sums a kernel finishes itself: the last of a tile's programs to arrive sums the
others' shares, so no second kernel is launched for it (CUTLASS's serial split-K order).

Public: `split_counters(device, tiles)`, the int32 counters (one buffer per device, zeros between launches), and
`COUNTERS`, how many tiles one launch may count. The nf4 tile kernel (`nf4_triton.sum_if_last`) and the decode
attention kernel (`decode_attention`) count their arrivals here. Limits: launches that use the counters must not
overlap on one device (one stream at a time, as token steps run); each launch leaves every counter at zero.
"""

from __future__ import annotations

import torch

COUNTERS = 4096  # tiles one launch may count
_counters: dict[torch.device, torch.Tensor] = {}  # a device's counters


def split_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The per-tile arrival counters of a launch of `tiles` tiles: int32 zeros, one buffer per device, each launch
    leaving them at zero. None, the caller then summing with a second kernel, for more tiles than the buffer holds,
    and while a CUDA graph is being captured before the device's buffer exists (an allocation there would belong to
    the graph)."""
    if tiles > COUNTERS:
        return None
    held = _counters.get(device)
    if held is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        held = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return held
