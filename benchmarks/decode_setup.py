"""Shared set-up of the decode diagnostics (`decode_profile.py`, `decode_variants.py`): the random-weight
Qwen3-VL-8B-shaped model with the bench's LoRA (r=16 on language attention + MLP), the seed's batch of 8
prompts x 4 generations, and the rollout sampling settings."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoProcessor

from vlmrl.bench import (
    LORA_TARGETS,
    BenchSettings,
    bench_dataset,
    build_processor,
    build_shaped_model,
    load_shapes,
)
from vlmrl.engine.rollout.fast import compile_settings, prefill_into_dynamic_cache
from vlmrl.engine.rollout.generation import encode_batch
from vlmrl.models.loading import multimodal_token_ids


def timed_generate(model: Any, batch: dict, tokens: int, **kwargs: Any) -> float:
    """Milliseconds per token step of one `generate` forced to `tokens` new tokens."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / tokens


def shaped_model_and_batch(*, lora_b_std: float = 0.0, pad_prompts_to: int | None = None,
                           load_in_4bit: bool = False) -> tuple[Any, dict, dict]:
    """(PEFT model in eval mode with the prompt pass on a dynamic cache, the CUDA batch, sampling kwargs).

    `lora_b_std` > 0 gives the adapter a trained-looking B (PEFT starts it at zero); `pad_prompts_to` left-pads
    the prompts to a multiple (how vlmrl bucketed before it bucketed the cache instead); `load_in_4bit` loads the
    base in bitsandbytes nf4, as the seed recipe does."""
    from peft import LoraConfig, get_peft_model

    work = Path(tempfile.mkdtemp())
    settings = BenchSettings()
    processor_dir = build_processor(work, settings.image_size)
    model = build_shaped_model(load_shapes(settings.shapes), processor_dir, load_in_4bit=load_in_4bit, work=work)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS))
    model.eval()
    if lora_b_std:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, lora_b_std)
    prefill_into_dynamic_cache(model)
    processor = AutoProcessor.from_pretrained(str(processor_dir))
    processor.tokenizer.padding_side = "left"
    data = bench_dataset(settings)
    prompts = [r["prompt"][0]["content"] for r in data.select(range(8))] * 4
    images = [r["image"] for r in data.select(range(8))] * 4
    batch = encode_batch(processor, prompts, images, torch.device("cuda"), bucket=pad_prompts_to)
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                    suppress_tokens=multimodal_token_ids(model.config), **compile_settings())
    return model, batch, sampling


def profile_summary(prof: Any, steps: int, *, kernels: int = 20, cpu_ops: int = 12) -> dict:
    """GPU kernel time per step and the top kernels and host ops of a `torch.profiler` run over `steps` steps."""
    averages = prof.key_averages()
    events = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:kernels]
    cpu = sorted((e for e in averages if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:cpu_ops]
    return {
        "gpu_kernel_ms_per_step": sum(e.self_device_time_total for e in events) / 1e3 / steps,
        "top_kernels": [{"name": e.key[:90], "ms_per_step": e.self_device_time_total / 1e3 / steps,
                         "calls_per_step": e.count / steps} for e in top],
        "top_cpu_ops": [{"name": e.key[:90], "ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                         "calls_per_step": e.count / steps} for e in cpu],
    }


def profile_tables(result: dict, label: str) -> list[str]:
    """Markdown tables of `profile_summary`'s kernels and host ops."""
    lines = [f"| kernel ({label}) | ms per step | calls per step |", "|---|---|---|"]
    lines += [f"| `{k['name']}` | {k['ms_per_step']:.3f} | {k['calls_per_step']:.0f} |" for k in result["top_kernels"]]
    lines += ["", f"| CPU op ({label}) | self ms per step | calls per step |", "|---|---|---|"]
    lines += [f"| `{k['name']}` | {k['ms_per_step']:.3f} | {k['calls_per_step']:.0f} |" for k in result["top_cpu_ops"]]
    return lines
