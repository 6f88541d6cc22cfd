"""Where a compiled decode step goes (diagnostic, not a benchmark of record; docs/benchmarks.md).

Outside TRL, on the same random-weight Qwen3-VL-8B shapes, batch 32 (8 prompts x 4), static cache +
torch.compile(reduce-overhead) + vlmrl_sdpa, as in vlmrl's rollouts. Measures, each from its own generate call:
  - ms per decode step with the LoRA adapter (r=16) active, sampling with the rollout logits processors;
  - the same, greedy without logits processors (what sampling and the processors cost);
  - the same without the adapter (what the LoRA layers cost; a recompile);
  - GPU busy time per decode step from torch.profiler (kernel time / wall time) and the top kernels;
  - peak memory in prefill vs decode (a logits processor reads the allocator after prefill).
Usage (CUDA): python benchmarks/decode_profile.py OUTDIR
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoProcessor, LogitsProcessor, LogitsProcessorList

from vlmrl.attention import use_packed_gqa
from vlmrl.bench import GIB, BenchSettings, bench_dataset, build_processor, build_shaped_model, load_shapes
from vlmrl.fastgen import compile_settings
from vlmrl.generation import encode_batch
from vlmrl.models.loading import multimodal_token_ids


class MemoryProbe(LogitsProcessor):
    """Called once per token step; the first call comes right after prefill."""

    def __init__(self):
        self.prefill_peak = None
        self.decode_peak = 0

    def __call__(self, input_ids, scores):
        peak = torch.cuda.max_memory_allocated()
        if self.prefill_peak is None:
            self.prefill_peak = peak
            torch.cuda.reset_peak_memory_stats()
        else:
            self.decode_peak = max(self.decode_peak, peak)
        return scores


def timed_generate(model, batch, tokens, **kwargs) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / tokens


def main(out: Path) -> None:
    from peft import LoraConfig, get_peft_model

    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    settings = BenchSettings()
    processor_dir = build_processor(work, settings.image_size)
    model = build_shaped_model(load_shapes(settings.shapes), processor_dir, load_in_4bit=False, work=work)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=(
        r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)")))
    model.eval()
    use_packed_gqa(model)
    processor = AutoProcessor.from_pretrained(str(processor_dir))
    processor.tokenizer.padding_side = "left"
    data = bench_dataset(settings)
    prompts = [r["prompt"][0]["content"] for r in data.select(range(8))] * 4
    images = [r["image"] for r in data.select(range(8))] * 4
    batch = encode_batch(processor, prompts, images, torch.device("cuda"), bucket=64)
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                    suppress_tokens=multimodal_token_ids(model.config), **compile_settings())
    greedy = dict(do_sample=False, **compile_settings())
    result: dict = {"batch": len(prompts), "prompt_tokens": int(batch["input_ids"].shape[1])}

    with torch.inference_mode():
        start = time.perf_counter()
        # The static cache is sized prompt + max_new_tokens, and a new size recompiles: warm up at the measured
        # length (the first run of this script warmed up at 16 tokens, so its sampling figure included a recompile).
        timed_generate(model, batch, 256, **sampling)
        result["first_call_seconds"] = time.perf_counter() - start
        torch.cuda.reset_peak_memory_stats()
        probe = MemoryProbe()
        result["sampling_lora_ms"] = timed_generate(model, batch, 256, logits_processor=LogitsProcessorList([probe]),
                                                    **sampling)
        result["prefill_peak_gib"] = probe.prefill_peak / GIB
        result["decode_peak_gib"] = probe.decode_peak / GIB
        result["greedy_lora_ms"] = timed_generate(model, batch, 256, **greedy)
        from torch.profiler import ProfilerActivity, profile

        steps = 256  # long enough that the prefill inside the profiled call is a small share
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = timed_generate(model, batch, steps, **sampling) * steps
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_us = sum(e.self_device_time_total for e in events)
        result["profiled_wall_ms_per_step"] = wall / steps
        result["gpu_kernel_ms_per_step"] = kernel_us / 1e3 / steps
        top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:15]
        result["top_kernels"] = [{"name": e.key[:90], "ms_per_step": e.self_device_time_total / 1e3 / steps,
                                  "calls_per_step": e.count / steps} for e in top]
        with model.disable_adapter():
            timed_generate(model, batch, 256, **sampling)  # recompiles without the LoRA branches
            result["sampling_no_lora_ms"] = timed_generate(model, batch, 256, **sampling)

    (out / "decode_profile.json").write_text(json.dumps(result, indent=2))
    lines = [f"batch {result['batch']}, prompt {result['prompt_tokens']} tokens, 256 forced tokens per call", "",
             "| measure | value |", "|---|---|"]
    for key in ("sampling_lora_ms", "greedy_lora_ms", "sampling_no_lora_ms", "profiled_wall_ms_per_step",
                "gpu_kernel_ms_per_step", "prefill_peak_gib", "decode_peak_gib", "first_call_seconds"):
        lines.append(f"| {key} | {result[key]:.2f} |")
    lines += ["", "| kernel | ms per step | calls per step |", "|---|---|---|"]
    lines += [f"| `{k['name']}` | {k['ms_per_step']:.3f} | {k['calls_per_step']:.0f} |" for k in result["top_kernels"]]
    (out / "decode_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "decode-profile"))
