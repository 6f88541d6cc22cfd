"""Batched image+question generation with Hugging Face `generate`, shared by evaluation and the SFT check.

One prompt layout for every family: the item's system message when it has one, then a user turn holding the
item's images (in order) and the prompt text,
rendered by the processor's own chat template (so Qwen's `<|vision_start|><|image_pad|>...` and Gemma's
`<start_of_image>` land where each family expects them).

On CUDA with `compile` on, decoding uses a static KV cache and `torch.compile` (several times faster per token:
benchmarks/NOTES.md), with the stop check read one step late so the host does not wait on
the device between token steps (`vlmrl.engine.rollout.fast.deferred_stop_check`), and answers that have ended
no longer read their KV cache (`vlmrl.engine.rollout.finished`); each token step gets its own tokens' type ids only
(`vlmrl.engine.rollout.step_inputs`), and a function dynamo stops compiling is said at WARNING
(`vlmrl.engine.recompiles`).
On the CPU the plain dynamic-cache path is used: compilation costs more than it saves for tiny models.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image


@dataclass(frozen=True)
class Generation:
    text: str
    tokens: int  # generated tokens up to and including the first end-of-turn token
    truncated: bool  # hit max_new_tokens without an end-of-turn token


PromptImages = Image.Image | list[Image.Image]  # one prompt's image, or its images in order


def build_messages(prompt: str, num_images: int = 1, system: str | None = None) -> list[dict]:
    """The system turn (when given), then the user turn: the item's images in order, then the text (TRL's layout
    for dataset images)."""
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": prompt}]
    head = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
    return head + [{"role": "user", "content": content}]


def render_prompt(processor: Any, prompt: str, num_images: int = 1, system: str | None = None) -> str:
    return processor.apply_chat_template(
        build_messages(prompt, num_images, system), add_generation_prompt=True, tokenize=False
    )


def per_prompt_images(images: list[PromptImages]) -> list[list[Image.Image]]:
    """Each prompt's images as a list (a single image is the one-element case)."""
    return [list(img) if isinstance(img, (list, tuple)) else [img] for img in images]


def encode_batch(
    processor: Any,
    prompts: list[str],
    images: list[PromptImages],
    device: torch.device,
    *,
    bucket: int | None = None,
    systems: list[str | None] | None = None,
) -> dict:
    lists = per_prompt_images(images)
    systems = systems or [None] * len(prompts)
    texts = [render_prompt(processor, p, len(imgs), s) for p, imgs, s in zip(prompts, lists, systems, strict=True)]
    extra = {"pad_to_multiple_of": bucket} if bucket else {}
    batch = processor(text=texts, images=lists, padding=True, return_tensors="pt", **extra)
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}


def count_prompt_tokens(processor: Any, prompt: str, images: PromptImages) -> int:
    """Tokens the model sees for one prompt, image tokens included (the data stage's prompt budget)."""
    (imgs,) = per_prompt_images([images])
    batch = processor(text=[render_prompt(processor, prompt, len(imgs))], images=[imgs], return_tensors="pt")
    return int(batch["input_ids"].shape[1])



@torch.inference_mode()
def generate_batch(
    model: Any,
    processor: Any,
    prompts: list[str],
    images: list[PromptImages],
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    num_return_sequences: int = 1,
    compiled: bool = False,
    compile_all_devices: bool = False,
    systems: list[str | None] | None = None,
) -> list[list[Generation]]:
    """Generate for each prompt (after its system message, if `systems` gives one); returns one list of
    `num_return_sequences` generations per prompt."""
    device = next(model.parameters()).device
    tokenizer = processor.tokenizer
    stop_ids = _stop_token_ids(model, tokenizer)
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "do_sample": do_sample,
        "num_return_sequences": num_return_sequences,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0],
        "eos_token_id": stop_ids,
    }
    if do_sample:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    bucket = None
    stop_check: Any = contextlib.nullcontext()
    if compiled:
        from vlmrl.engine.recompiles import reported_recompile_limits
        from vlmrl.engine.rollout.attention import decode_kernel, use_packed_gqa
        from vlmrl.engine.rollout.fast import (
            bucket_static_cache,
            compile_settings,
            deferred_stop_check,
            prefill_into_dynamic_cache,
        )
        from vlmrl.engine.rollout.finished import finished_rows_read_one_block
        from vlmrl.engine.rollout.quantized_base import compile_over_4bit
        from vlmrl.engine.rollout.step_inputs import step_token_inputs

        use_packed_gqa(model)
        prefill_into_dynamic_cache(model)
        # Compiled decoding recompiles per cache length: bucket it so a whole evaluation sees few (rollout.fast);
        # where the cache cannot be bucketed, the prompts are.
        bucket = None if bucket_static_cache(model, 64) else 64
        kwargs.update(compile_settings(all_devices=compile_all_devices))
        stop_check = contextlib.ExitStack()
        stop_check.enter_context(deferred_stop_check())
        stop_check.enter_context(compile_over_4bit(model))
        stop_check.enter_context(decode_kernel())
        stop_check.enter_context(finished_rows_read_one_block(model))
        stop_check.enter_context(step_token_inputs(model))
        stop_check.enter_context(reported_recompile_limits())
    batch = encode_batch(processor, prompts, images, device, bucket=bucket, systems=systems)
    with stop_check:
        output = model.generate(**batch, **kwargs)
    new_tokens = output[:, batch["input_ids"].shape[1] :]  # [B*k, T]
    results: list[Generation] = []
    for row in new_tokens.tolist():
        length = next((i + 1 for i, tok in enumerate(row) if tok in stop_ids), None)
        kept = row[: length if length is not None else len(row)]
        text = tokenizer.decode(kept, skip_special_tokens=True)
        results.append(Generation(text=text, tokens=len(kept), truncated=length is None and len(row) >= max_new_tokens))
    return [results[i : i + num_return_sequences] for i in range(0, len(results), num_return_sequences)]


def _stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else ([ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model has no end-of-sequence token in its generation config or tokenizer")
    return ids
