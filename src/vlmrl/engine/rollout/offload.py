"""The optimizer's state waits in host memory while a rollout runs.

Adam keeps two float32 moments per trainable parameter on the GPU (8 bytes per adapter parameter), and
nothing reads them between one optimizer step and the next: a rollout never does. `OptimizerStateOffload` copies
every GPU tensor of the optimizer's state into pinned host buffers when a rollout starts, drops the GPU tensors
(their memory goes back to the allocator for the rollout's KV cache), and copies them back when it ends, raising
or not. The values come back bit for bit; the host buffers are allocated once and reused.

Why: the rollout's bf16 adapter copies (`vlmrl.engine.rollout.adapter_cast`) cost 2 bytes per adapter parameter while a
rollout runs; the state frees 8. The step's peak, which plain TRL's loss pass sets, stays where it was.
Cost: two copies of the state per step over PCIe, small against a step (benchmarks/NOTES.md). Not used under FSDP / DeepSpeed (sharded state) or for state that is not plain device
memory (bitsandbytes' paged optimizers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class OptimizerStateOffload:
    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.host: dict[tuple[int, str], torch.Tensor] = {}  # (parameter id, state key) -> pinned buffer
        self.moved_bytes = 0  # at the last rollout

    def _state(self) -> dict:
        optimizer = getattr(self.trainer, "optimizer", None)
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        return getattr(optimizer, "state", None) or {}

    def _buffer(self, key: tuple[int, str], value: torch.Tensor) -> torch.Tensor:
        host = self.host.get(key)
        if host is None or host.shape != value.shape or host.dtype != value.dtype:
            host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=torch.cuda.is_available())
            self.host[key] = host
        return host

    def _to_host(self) -> list[tuple[dict, str, torch.device, torch.Tensor]]:
        """Copy the state's device tensors into host buffers and drop them; what was moved, to put back. (A helper
        of its own so that no local variable of the rollout's frame keeps a device tensor alive.)"""
        moved = []
        for param, entries in self._state().items():
            for name, value in entries.items():
                if _offloadable(value):
                    host = self._buffer((id(param), name), value)
                    host.copy_(value, non_blocking=True)
                    moved.append((entries, name, value.device, host))
        if moved and torch.cuda.is_available():
            torch.cuda.synchronize()  # the host holds the values before the device memory is given back
        for entries, name, _, host in moved:
            entries[name] = host  # the last reference to the device tensor: its memory is free for the rollout
        self.moved_bytes = sum(host.nbytes for *_, host in moved)
        return moved

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        moved = self._to_host()
        try:
            yield
        finally:
            for entries, name, device, host in moved:
                entries[name] = host.to(device, non_blocking=True, copy=True)  # stream-ordered before later kernels

def _offloadable(value: Any) -> bool:
    """A device tensor of the state worth moving: not a step counter, not bitsandbytes' paged memory."""
    return (isinstance(value, torch.Tensor) and value.device.type != "cpu" and value.numel() > 1
            and not getattr(value, "is_paged", False))
