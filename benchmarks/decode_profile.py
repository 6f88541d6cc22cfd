"""Where a compiled decode step goes (diagnostic, not a benchmark of record; benchmarks/NOTES.md).

Outside TRL, on the same random-weight Qwen3-VL-8B shapes, batch 32 (8 prompts x 4), static cache +
torch.compile(reduce-overhead) + vlmrl_sdpa + the prompt pass on a dynamic cache, as in vlmrl's rollouts.
Measures, each from its own generate call (warmed up at the measured length, so no call includes a compile):
  - ms per decode step with the LoRA adapter (r=16) active, sampling with the rollout logits processors;
  - the same with the adapter merged (`benchmarks/variants/merge.py`'s `RolloutMerge`, an experiment);
  - on the merged path: GPU busy time per decode step from torch.profiler (kernel time / wall time) and the top
    kernels; peak memory in the prompt pass vs in decoding (a logits processor reads the allocator).
Usage (CUDA): python benchmarks/decode_profile.py OUTDIR [TOKENS]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from decode_setup import profile_summary, profile_tables, shaped_model_and_batch, timed_generate
from transformers import LogitsProcessor, LogitsProcessorList
from variants.merge import RolloutMerge

from vlmrl.bench import GIB
from vlmrl.engine.rollout.attention import use_packed_gqa


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


def main(out: Path, tokens: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model, batch, sampling = shaped_model_and_batch(pad_prompts_to=64)  # as measured (h200_decode_profile)
    use_packed_gqa(model)
    result: dict = {"batch": len(batch["input_ids"]), "prompt_tokens": int(batch["input_ids"].shape[1]), "tokens": tokens}
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
    result["profiled_wall_ms_per_step"] = wall / steps
    result |= profile_summary(prof, steps)

    (out / "decode_profile.json").write_text(json.dumps(result, indent=2))
    title = f"batch {result['batch']}, prompt {result['prompt_tokens']} tokens, {tokens} forced tokens per call (profile: 256)"
    lines = [title, "", "| measure | value |", "|---|---|"]
    for key in ("sampling_lora_ms", "sampling_merged_ms", "profiled_wall_ms_per_step", "gpu_kernel_ms_per_step",
                "prefill_peak_gib", "decode_peak_gib", "first_call_seconds", "merged_first_call_seconds",
                "merge_seconds", "merge_and_restore_seconds"):
        lines.append(f"| {key} | {result[key]:.3f} |")
    lines += ["", *profile_tables(result, "merged path")]
    (out / "decode_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "decode-profile"), int(sys.argv[2]) if len(sys.argv) > 2 else 1024)
