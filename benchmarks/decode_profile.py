"""Where a compiled decode step goes (diagnostic, not a benchmark of record; docs/benchmarks.md).

Outside TRL, on the same random-weight Qwen3-VL-8B shapes, batch 32 (8 prompts x 4), static cache +
torch.compile(reduce-overhead) + vlmrl_sdpa + the prompt pass on a dynamic cache, as in vlmrl's rollouts.
Measures, each from its own generate call (warmed up at the measured length, so no call includes a compile):
  - ms per decode step with the LoRA adapter (r=16) active, sampling with the rollout logits processors;
  - the same with the adapter merged (`vlmrl.merge.RolloutMerge`, what vlmrl's rollouts run);
  - on the merged path: GPU busy time per decode step from torch.profiler (kernel time / wall time) and the top
    kernels; peak memory in the prompt pass vs in decoding (a logits processor reads the allocator).
Usage (CUDA): python benchmarks/decode_profile.py OUTDIR [TOKENS]
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
from vlmrl.fastgen import compile_settings, prefill_into_dynamic_cache
from vlmrl.generation import encode_batch
from vlmrl.merge import RolloutMerge
from vlmrl.models.loading import multimodal_token_ids


class MemoryProbe(LogitsProcessor):
    """Called once per token step; the first call comes right after the prompt pass."""

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


def main(out: Path, tokens: int) -> None:
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
    prefill_into_dynamic_cache(model)
    processor = AutoProcessor.from_pretrained(str(processor_dir))
    processor.tokenizer.padding_side = "left"
    data = bench_dataset(settings)
    prompts = [r["prompt"][0]["content"] for r in data.select(range(8))] * 4
    images = [r["image"] for r in data.select(range(8))] * 4
    batch = encode_batch(processor, prompts, images, torch.device("cuda"), bucket=64)
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                    suppress_tokens=multimodal_token_ids(model.config), **compile_settings())
    result: dict = {"batch": len(prompts), "prompt_tokens": int(batch["input_ids"].shape[1]), "tokens": tokens}
    merge = RolloutMerge(model)

    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        start = time.perf_counter()
        timed_generate(model, batch, tokens, **sampling)
        result["first_call_seconds"] = time.perf_counter() - start
        result["sampling_lora_ms"] = timed_generate(model, batch, tokens, **sampling)
        with merge.merged():
            start = time.perf_counter()
            timed_generate(model, batch, tokens, **sampling)  # compiles the graph without LoRA branches
            result["merged_first_call_seconds"] = time.perf_counter() - start
            torch.cuda.reset_peak_memory_stats()
            probe = MemoryProbe()
            result["sampling_merged_ms"] = timed_generate(model, batch, tokens,
                                                          logits_processor=LogitsProcessorList([probe]), **sampling)
            result["prefill_peak_gib"] = probe.prefill_peak / GIB
            result["decode_peak_gib"] = probe.decode_peak / GIB
            from torch.profiler import ProfilerActivity, profile

            steps = 256
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                wall = timed_generate(model, batch, steps, **sampling) * steps
        torch.cuda.synchronize()
        start = time.perf_counter()
        with merge.merged():
            torch.cuda.synchronize()
            result["merge_seconds"] = time.perf_counter() - start
        torch.cuda.synchronize()
        result["merge_and_restore_seconds"] = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.self_device_time_total for e in events)
    result["profiled_wall_ms_per_step"] = wall / steps
    result["gpu_kernel_ms_per_step"] = kernel_us / 1e3 / steps
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:20]
    result["top_kernels"] = [{"name": e.key[:90], "ms_per_step": e.self_device_time_total / 1e3 / steps,
                              "calls_per_step": e.count / steps} for e in top]
    cpu = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    result["top_cpu_ops"] = [{"name": e.key[:90], "ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                              "calls_per_step": e.count / steps} for e in cpu]

    (out / "decode_profile.json").write_text(json.dumps(result, indent=2))
    title = f"batch {result['batch']}, prompt {result['prompt_tokens']} tokens, {tokens} forced tokens per call (profile: 256)"
    lines = [title, "", "| measure | value |", "|---|---|"]
    for key in ("sampling_lora_ms", "sampling_merged_ms", "profiled_wall_ms_per_step", "gpu_kernel_ms_per_step",
                "prefill_peak_gib", "decode_peak_gib", "first_call_seconds", "merged_first_call_seconds",
                "merge_seconds", "merge_and_restore_seconds"):
        lines.append(f"| {key} | {result[key]:.3f} |")
    lines += ["", "| kernel (merged path) | ms per step | calls per step |", "|---|---|---|"]
    lines += [f"| `{k['name']}` | {k['ms_per_step']:.3f} | {k['calls_per_step']:.0f} |" for k in result["top_kernels"]]
    lines += ["", "| CPU op (merged path) | self ms per step | calls per step |", "|---|---|---|"]
    lines += [f"| `{k['name']}` | {k['ms_per_step']:.3f} | {k['calls_per_step']:.0f} |" for k in result["top_cpu_ops"]]
    (out / "decode_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "decode-profile"), int(sys.argv[2]) if len(sys.argv) > 2 else 1024)
