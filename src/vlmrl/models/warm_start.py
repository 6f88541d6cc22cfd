"""Supervised warm start: teach a policy the output structure before RL (a "format cold start").

RL needs a policy that sometimes earns reward; a model that never writes `<SOLUTION>` gives GRPO groups with
identical rewards and no signal. A few supervised steps on contract-shaped answers fix that. The loss is
on the assistant turn only (prompt and padding masked), rendered with the model's own chat template so the
end-of-turn token is learned too.

Deliberately small: a plain AdamW loop over (prompt, image, target) triples, for warm starts of minutes,
not a general SFT trainer (use TRL's `SFTTrainer` for that).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
) -> list[float]:
    """Train `model` in place for `steps` AdamW steps on random batches of `examples`; returns the losses.
    `on_step(step, loss)` is called after each step; a true return stops training there.
    `bf16_autocast` runs forward and backward under bfloat16 autocast (weights and optimizer stay float32).
    `prefetch` builds the next batch on a worker thread while this one trains (on a GPU the processor, not the
    model, is the bottleneck); the batches and their order are the same either way."""
    if not examples:
        raise ValueError("sft_train: no examples")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
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
