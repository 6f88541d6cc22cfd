"""What each rollout decode setting is worth, and where the host still waits (diagnostic; benchmarks/NOTES.md).

Outside TRL, random-weight Qwen3-VL-8B shapes, batch 32 (8 prompts x 4), LoRA r=16, the compiled static-cache
path of vlmrl's rollouts (vlmrl_sdpa, prompt pass on a dynamic cache, cache bucketed), sampling. Each variant
is warmed up at the measured length, so no timed call includes a compile. Variants, in one process:
  lora            adapters in float32 under the rollout's bf16 autocast (the path before this change)
  lora+deferred   the same, with transformers' stop check read one step late (`rollout.fast.deferred_stop_check`)
  bf16            the adapters' bf16 copies swapped in (`vlmrl.engine.rollout.adapter_cast`), under the same autocast
  bf16+deferred   both
  merged+deferred adapter merged into the weights (benchmarks/variants/merge.py, an experiment)
  bf16+deferred+kernel, merged+deferred+kernel   those two with token steps' attention through vlmrl's Triton
                  kernel (`vlmrl.engine.rollout.decode_attention`; rollouts' default now)
  stacked+deferred+kernel   the stacked projections (`vlmrl.engine.rollout.stacked`, rollouts' default) instead
                  of the copies: q/k/v and gate/up as one matmul each with the adapters' first factors; the base
                  weights are stacked (once) when this variant is asked for, before any variant runs; the
                  prompt pass's last-position logits are then compared with the copies' (`stacked_logits`)
  stacked+deferred+kernel+guards-once   the same, dynamo's guards checked at each call's first token step only
                  (`guards_once`, benchmarks/variants/rollout.py, an experiment)
Then, on bf16+deferred: the host syncs per token step that remain (torch.cuda sync debug mode, with the Python
frames that caused them), and on PROFILE (default bf16+deferred) a profile of 256 tokens (GPU kernel time per
step, top kernels; PROFILE=none skips it). VARIANTS=a,b,... runs those variants only (the host syncs then only
where measured).
Usage (CUDA): [VARIANTS=...] [PROFILE=...] python benchmarks/decode_variants.py OUTDIR [TOKENS]
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from decode_setup import profile_summary, profile_tables, shaped_model_and_batch, timed_generate
from variants.merge import RolloutMerge
from variants.rollout import guards_once

from vlmrl.engine.rollout.adapter_cast import LowPrecisionAdapters
from vlmrl.engine.rollout.attention import decode_kernel, packed_gqa, use_packed_gqa
from vlmrl.engine.rollout.fast import bucket_static_cache, deferred_stop_check
from vlmrl.engine.rollout.stacked import StackedProjections


def host_syncs(model, batch, steps, **kwargs) -> dict:
    """Synchronizing CUDA calls during one generate of `steps` tokens, by the innermost frames that made them."""
    seen: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        seen[" <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames[-4:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model.generate(**batch, max_new_tokens=steps, min_new_tokens=steps, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return {"per_step": sum(seen.values()) / steps, "sites": {k: v / steps for k, v in seen.most_common(12)}}


def compare_logits(model, batch, reference: list, candidate: list) -> dict:
    """The prompt pass's last-position logits under two sets of rollout contexts: largest difference, the
    reference's largest magnitude, and how often the most likely token agrees."""
    logits = []
    for contexts in (reference, candidate):
        with torch.inference_mode(), contextlib.ExitStack() as stack:
            for factory in contexts:
                stack.enter_context(factory())
            logits.append(model(**batch, logits_to_keep=1).logits[:, -1].float())
    ref, got = logits
    return {"max_abs_diff": (got - ref).abs().max().item(), "reference_max_abs": ref.abs().max().item(),
            "argmax_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def main(out: Path, tokens: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # a trained-looking adapter, so the merge and the copies carry something
    model, batch, sampling = shaped_model_and_batch(lora_b_std=1e-3)
    bucket_static_cache(model, 64)
    copies = LowPrecisionAdapters(model, torch.bfloat16)
    merge = RolloutMerge(model)
    merge.keep_originals()
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
    variants = {
        "lora": [autocast],
        "lora+deferred": [autocast, deferred_stop_check],
        "bf16": [copies.active, autocast],  # as the trainer runs them (autocast then casts nothing)
        "bf16+deferred": [copies.active, autocast, deferred_stop_check],
        "merged+deferred": [merge.merged, deferred_stop_check],
        "bf16+deferred+kernel": [copies.active, autocast, deferred_stop_check, decode_kernel],
        "merged+deferred+kernel": [merge.merged, deferred_stop_check, decode_kernel],
        "stacked+deferred+kernel": [lambda: stacked.active(), autocast, deferred_stop_check, decode_kernel],
        "stacked-fused+deferred+kernel": [lambda: stacked.active(fused=True), autocast, deferred_stop_check,
                                          decode_kernel],
        "stacked+deferred+kernel+guards-once": [lambda: stacked.active(), autocast, deferred_stop_check, decode_kernel,
                                                lambda: guards_once(model)],
    }
    if os.environ.get("VARIANTS"):
        variants = {name: variants[name] for name in os.environ["VARIANTS"].split(",")}
    stacked = StackedProjections(model) if any(name.startswith("stacked") for name in variants) else None
    profiled = os.environ.get("PROFILE", "bf16+deferred")
    result: dict = {"batch": len(batch["input_ids"]), "prompt_tokens": int(batch["input_ids"].shape[1]), "tokens": tokens,
                    "adapter_copy_gib": copies.nbytes / 2**30, "ms_per_step": {}, "first_call_seconds": {}}
    use_packed_gqa(model)

    def run(name, fn):
        with torch.inference_mode(), contextlib.ExitStack() as stack:
            stack.enter_context(packed_gqa(model))
            for factory in variants[name]:
                stack.enter_context(factory())
            return fn()

    if stacked is not None:
        result["stacked_logits"] = compare_logits(model, batch, [copies.active, autocast], [stacked.active, autocast])
        print("stacked vs copies, prompt pass:", result["stacked_logits"], flush=True)
    for name in variants:
        start = time.perf_counter()
        run(name, lambda: timed_generate(model, batch, tokens, **sampling))
        result["first_call_seconds"][name] = time.perf_counter() - start
        result["ms_per_step"][name] = run(name, lambda: timed_generate(model, batch, tokens, **sampling))
        print(name, f"{result['ms_per_step'][name]:.2f} ms/step", flush=True)
    synced = [name for name in ("lora", "bf16+deferred") if name in variants]
    for name in synced:
        result[f"host_syncs_{name}"] = run(name, lambda: host_syncs(model, batch, tokens, **sampling))
        print(name, json.dumps(result[f"host_syncs_{name}"], indent=1), flush=True)
    (out / "decode_variants.json").write_text(json.dumps(result, indent=2))  # in case the profile runs out of time

    from torch.profiler import ProfilerActivity, profile

    if profiled == "none":
        return
    steps = min(tokens, 256)
    run(profiled, lambda: timed_generate(model, batch, steps, **sampling))  # the shorter cache compiled unprofiled
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = run(profiled, lambda: timed_generate(model, batch, steps, **sampling)) * steps
    result["profiled"] = profiled
    result["profiled_wall_ms_per_step"] = wall / steps
    result |= profile_summary(prof, steps, kernels=24, cpu_ops=10)

    (out / "decode_variants.json").write_text(json.dumps(result, indent=2))
    lines = [f"batch {result['batch']}, prompt {result['prompt_tokens']} tokens, {tokens} forced tokens per call", "",
             "| variant | ms per token step | first call s |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {result['first_call_seconds'][k]:.0f} |" for k, v in result["ms_per_step"].items()]
    lines += ["", (f"{profiled} under the profiler ({steps} tokens): {result['profiled_wall_ms_per_step']:.2f} ms "
              f"wall, {result['gpu_kernel_ms_per_step']:.2f} ms GPU kernels per step"), ""]
    if "stacked_logits" in result:
        lines += [f"stacked vs the adapter copies, prompt pass's last-position logits: {result['stacked_logits']}", ""]
    for name in synced:
        syncs = result[f"host_syncs_{name}"]
        lines += [f"host syncs per step, {name}: {syncs['per_step']:.2f}", ""]
        lines += [f"- {v:.2f}/step `{k}`" for k, v in syncs["sites"].items()] + [""]
    lines += profile_tables(result, profiled)
    (out / "decode_variants.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "decode-variants"), int(sys.argv[2]) if len(sys.argv) > 2 else 1024)
