"""Supervised warm start: teach a policy the output structure before RL (a "format cold start").

RL needs a policy that sometimes earns reward; a model that never writes `<SOLUTION>` gives GRPO groups with
identical rewards and no signal. A few supervised steps on contract-shaped answers fix that. The loss is
on the assistant turn only (prompt and padding masked), rendered with the model's own chat template so the
end-of-turn token is learned too.

Deliberately small: a plain AdamW loop over (prompt, image, target) triples, for warm starts of minutes,
not a general SFT trainer (use TRL's `SFTTrainer` for that). Public: `SftExample`, `sft_batch`, `sft_train`,
`Ema` (a moving average of the weights, swapped in for checks and kept at the end) and `lr_factor` (linear
warmup, then constant or cosine decay to a floor).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from vlmrl.engine.rollout.generation import build_messages, render_prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SftExample:
    prompt: str
    image: Image.Image
    target: str  # the assistant text, e.g. contract.render_answer(reasoning, solution)


def sft_batch(processor: Any, examples: list[SftExample], device: torch.device,
              lengths: dict[tuple[str, tuple[int, int]], int] | None = None) -> dict:
    """Inputs with labels: -100 on padding and on every prompt token, the assistant turn kept. `lengths`
    caches each (prompt, image size)'s token count across calls: a prompt's count depends on nothing else, and
    counting it runs the image processor (most of a GPU warm start's time, without the cache)."""
    fulls, prompt_lengths = [], []
    lengths = {} if lengths is None else lengths
    for ex in examples:
        prompt = render_prompt(processor, ex.prompt)
        messages = build_messages(ex.prompt) + [{"role": "assistant", "content": [{"type": "text", "text": ex.target}]}]
        full = processor.apply_chat_template(messages, tokenize=False)
        if not full.startswith(prompt):
            raise ValueError("the chat template renders the prompt differently with and without an answer")
        fulls.append(full)
        key = (prompt, ex.image.size)
        if key not in lengths:  # the prompt's token count, image tokens included
            lengths[key] = processor(text=[prompt], images=[[ex.image]], return_tensors="pt")["input_ids"].shape[1]
        prompt_lengths.append(lengths[key])
    batch = processor(text=fulls, images=[[ex.image] for ex in examples], padding=True, return_tensors="pt")
    labels = batch["input_ids"].clone()  # [B, L]
    width = labels.shape[1]
    for row, prompt_len in enumerate(prompt_lengths):
        pad = width - int(batch["attention_mask"][row].sum())  # left padding
        labels[row, : pad + prompt_len] = -100
    batch["labels"] = labels
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}


class Ema:
    """An exponential moving average of a model's trainable weights (float32, on the model's device).

    `update()` after each optimizer step; `swapped()` puts the average into the model for the duration of a
    `with` block (a check scored on the averaged weights) and restores the live weights after; `snapshot()` is
    a CPU copy of the average, `load(snapshot)` writes one into the model for good."""

    def __init__(self, model: Any, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"Ema: decay must lie in (0, 1), got {decay}")
        self.decay = decay
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.average = {n: p.detach().float().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for name, p in self.params.items():
            self.average[name].lerp_(p.detach().float(), 1.0 - self.decay)

    @contextmanager
    def swapped(self) -> Iterator[None]:
        live = {n: p.detach().clone() for n, p in self.params.items()}
        self._write(self.average)
        try:
            yield
        finally:
            self._write(live)

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().to("cpu", copy=True) for n, t in self.average.items()}

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        self._write(weights)

    @torch.no_grad()
    def _write(self, weights: dict[str, torch.Tensor]) -> None:
        for name, p in self.params.items():
            p.copy_(weights[name].to(p.device, p.dtype))


def lr_factor(step: int, *, steps: int, warmup_steps: int = 0, schedule: str = "constant",
              floor: float = 0.1) -> float:
    """The learning rate's multiplier at optimizer step `step` (0-based): linear warmup over `warmup_steps`,
    then constant, or cosine from 1 down to `floor` at the last of `steps`."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"lr_factor: unknown schedule {schedule!r} (constant | cosine)")
    span = max(1, steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / span)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def sft_train(
    model: Any,
    processor: Any,
    examples: list[SftExample],
    *,
    steps: int,
    batch_size: int = 16,
    learning_rate: float = 2e-3,
    seed: int = 0,
    on_step: Callable[[int, float], bool | None] | None = None,
    bf16_autocast: bool = False,
    prefetch: bool = False,
    warmup_steps: int = 0,
    schedule: str = "constant",
    ema: Ema | None = None,
    adam_beta2: float = 0.999,
) -> list[float]:
    """Train `model` in place for `steps` AdamW steps on random batches of `examples`; returns the losses.
    `on_step(step, loss)` is called after each step; a true return stops training there.
    `bf16_autocast` runs forward and backward under bfloat16 autocast (weights and optimizer stay float32).
    `prefetch` builds the next batch on a worker thread while this one trains (on a GPU the processor, not the
    model, is the bottleneck); the batches and their order are the same either way. `warmup_steps` and
    `schedule` shape the learning rate (`lr_factor`); `ema`, when given, is updated after every step.
    `adam_beta2` below the default (e.g. 0.95) lets AdamW's second moment follow a sudden large gradient within
    a few steps, instead of taking one outsized step on it (the loss spikes a from-scratch warm start shows)."""
    if not examples:
        raise ValueError("sft_train: no examples")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, betas=(0.9, adam_beta2), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, steps=steps, warmup_steps=warmup_steps, schedule=schedule))
    device = next(model.parameters()).device
    model.train()
    losses: list[float] = []
    lengths: dict[tuple[str, tuple[int, int]], int] = {}
    draws = (rng.sample(examples, min(batch_size, len(examples))) for _ in range(steps))  # drawn in step order

    def build(chosen: list[SftExample]) -> dict:
        return sft_batch(processor, chosen, device, lengths)

    with ThreadPoolExecutor(max_workers=1) as pool:
        upcoming = pool.submit(build, next(draws)) if prefetch and steps else None
        for step in range(steps):
            if upcoming is None:
                batch = build(next(draws))
            else:
                batch = upcoming.result()
                upcoming = pool.submit(build, next(draws)) if step + 1 < steps else None
            losses.append(_step(model, batch, params, optimizer, bf16_autocast))
            scheduler.step()
            if ema is not None:
                ema.update()
            if on_step and on_step(step + 1, losses[-1]):
                break
    model.eval()
    return losses


def _step(model: Any, batch: dict, params: list, optimizer: torch.optim.Optimizer, bf16_autocast: bool) -> float:
    """One AdamW step on `batch`; its loss."""
    device_type = batch["input_ids"].device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16_autocast):
        loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())
