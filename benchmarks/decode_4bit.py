"""Where the 4-bit rollout's decode time goes, and whether compiling over bitsandbytes keeps its numerics
(diagnostic for the seed's 4-bit recipe; benchmarks/NOTES.md).

Outside TRL, random-weight Qwen3-VL-8B shapes loaded in bitsandbytes nf4, batch 32 (8 prompts x 4), LoRA r=16
with a trained-looking B, under the rollout contexts vlmrl uses (vlmrl_sdpa, bf16 autocast, deferred stop check,
cache bucketed). Variants, in one process:
  eager-dynamic   no compile settings: the dynamic-cache path plain TRL decodes with
  refused         the compile settings vlmrl passes, as before this change: transformers refuses to compile over
                  a bitsandbytes base and decodes eagerly over the static cache
  compiled        the same with `rollout.quantized_base.compile_over_4bit` (the refusal lifted)
For `compiled`: dynamo's graph-break count, and the rollout's log-probs of its own sampled tokens against the loss
pass's (a forward with gradients on, under the same autocast, over the same sequences), next to the same
comparison for the eager rollout.
Usage (CUDA, bitsandbytes >= 0.50): python benchmarks/decode_4bit.py OUTDIR [TOKENS [VARIANT,...]]
(eager-dynamic runs once, with no warm-up call: it compiles nothing)
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from decode_setup import profile_summary, shaped_model_and_batch

from vlmrl.engine.rollout.attention import packed_gqa, use_packed_gqa
from vlmrl.engine.rollout.fast import bucket_static_cache, deferred_stop_check
from vlmrl.engine.rollout.quantized_base import compile_over_4bit


def rollout_vs_loss_logprobs(model, batch: dict, tokens: int, sampling: dict, contexts, rows: int | None = None,
                             chunk: int = 8) -> dict:
    """Sample `tokens` tokens under `contexts`, then score the same sequences with gradients on: how far the
    rollout's log-probs of its own tokens are from the loss pass's. All rows by default: the compiled decode step
    then runs at the batch it was compiled for instead of compiling again; the loss pass goes `chunk` rows at a
    time."""
    rows = rows or batch["input_ids"].shape[0]
    small = {k: (v[:rows] if torch.is_tensor(v) and v.shape[0] == batch["input_ids"].shape[0] else v)
             for k, v in batch.items()}
    # pixel_values are flattened over images: 8 prompts x 4 generations, so the first `rows` rows are prompts
    # 0..rows-1 whose patches come first
    per_image = batch["pixel_values"].shape[0] // batch["input_ids"].shape[0]
    small["pixel_values"] = batch["pixel_values"][: rows * per_image]
    small["image_grid_thw"] = batch["image_grid_thw"][:rows]
    with torch.inference_mode(), contextlib.ExitStack() as stack:
        for factory in contexts:
            stack.enter_context(factory())
        out = model.generate(**small, max_new_tokens=tokens, min_new_tokens=tokens, output_logits=True,
                             return_dict_in_generate=True, **sampling)
    prompt_len = small["input_ids"].shape[1]
    completion = out.sequences[:, prompt_len:].clone()  # [B, T]; a normal tensor, usable under autograd
    rollout = torch.stack(out.logits, dim=1).float().log_softmax(-1)  # [B, T, V]
    rollout = rollout.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    del out
    mask = torch.cat([small["attention_mask"], torch.ones_like(completion)], dim=1)
    extra = {}
    if "mm_token_type_ids" in small:  # Qwen3-VL's M-RoPE needs to know which tokens are image tokens
        extra["mm_token_type_ids"] = torch.cat([small["mm_token_type_ids"], torch.zeros_like(completion)], dim=1)
    # as in training (gradient checkpointing makes the embeddings' output require grad): every bitsandbytes
    # layer then takes its autograd path (dequantize + matmul), not the inference op
    model.enable_input_require_grads()
    per_row = small["pixel_values"].shape[0] // rows
    scored = []
    try:
        for lo in range(0, rows, chunk):
            hi = min(rows, lo + chunk)
            part = {"mm_token_type_ids": extra["mm_token_type_ids"][lo:hi]} if extra else {}
            with torch.enable_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=torch.cat([small["input_ids"][lo:hi], completion[lo:hi]], 1),
                               attention_mask=mask[lo:hi], pixel_values=small["pixel_values"][lo * per_row: hi * per_row],
                               image_grid_thw=small["image_grid_thw"][lo:hi], **part).logits
            part_lp = logits[:, prompt_len - 1 : -1].float().log_softmax(-1)
            scored.append(part_lp.gather(-1, completion[lo:hi].unsqueeze(-1)).squeeze(-1).detach())
            del logits, part_lp
    finally:
        model.disable_input_require_grads()
    loss_pass = torch.cat(scored)
    diff = (rollout - loss_pass).abs()
    return {"rows": rows, "tokens": tokens, "max_abs": diff.max().item(), "mean_abs": diff.mean().item(),
            "seq_logprob_max_abs": (rollout.sum(1) - loss_pass.sum(1)).abs().max().item()}


def main(out: Path, tokens: int, names: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model, batch, sampling = shaped_model_and_batch(lora_b_std=1e-3, load_in_4bit=True)
    compiled_kwargs = {k: sampling[k] for k in ("cache_implementation", "compile_config")}
    eager_sampling = {k: v for k, v in sampling.items() if k not in compiled_kwargs}
    bucket_static_cache(model, 64)
    use_packed_gqa(model)
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
    gqa = lambda: packed_gqa(model)
    variants = {
        "eager-dynamic": ([gqa, autocast], eager_sampling),
        "refused": ([gqa, autocast, deferred_stop_check], sampling),
        "compiled": ([gqa, autocast, deferred_stop_check, lambda: compile_over_4bit(model)], sampling),
    }
    result: dict = {"batch": len(batch["input_ids"]), "prompt_tokens": int(batch["input_ids"].shape[1]),
                    "tokens": tokens, "ms_per_step": {}, "first_call_seconds": {},
                    "gpu_peak_gib": {}, "torch": torch.__version__}
    import bitsandbytes
    import transformers
    result["bitsandbytes"], result["transformers"] = bitsandbytes.__version__, transformers.__version__

    def timed(name: str) -> float:
        contexts, kwargs = variants[name]
        with torch.inference_mode(), contextlib.ExitStack() as stack:
            for factory in contexts:
                stack.enter_context(factory())
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start) / tokens

    for name in names:
        torch.cuda.reset_peak_memory_stats()
        torch._dynamo.utils.counters.clear()
        if name != "eager-dynamic":  # the compiled variants are timed after a first call at the same length
            start = time.perf_counter()
            timed(name)
            result["first_call_seconds"][name] = time.perf_counter() - start
        if name == "compiled":
            counters = torch._dynamo.utils.counters
            result["graph_breaks"] = {k: v for k, v in counters["graph_break"].most_common(12)}
            result["unique_graphs"] = counters["stats"].get("unique_graphs", 0)
        result["ms_per_step"][name] = timed(name)
        result["gpu_peak_gib"][name] = torch.cuda.max_memory_allocated() / 2**30
        print(name, f"{result['ms_per_step'][name]:.2f} ms/step", flush=True)
        (out / "decode_4bit.json").write_text(json.dumps(result, indent=2))

    for name in [n for n in ("eager-dynamic", "compiled") if n in names]:
        contexts, kwargs = variants[name]
        result[f"logprobs_{name}"] = rollout_vs_loss_logprobs(model, batch, min(tokens, 128), kwargs, contexts)
        print(name, result[f"logprobs_{name}"], flush=True)
    (out / "decode_4bit.json").write_text(json.dumps(result, indent=2))

    from torch.profiler import ProfilerActivity, profile

    contexts, kwargs = variants["compiled"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result["profiled_wall_ms_per_step"] = timed("compiled")
    result |= profile_summary(prof, tokens, kernels=12, cpu_ops=8)
    (out / "decode_4bit.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "decode-4bit"), int(sys.argv[2]) if len(sys.argv) > 2 else 256,
         sys.argv[3].split(",") if len(sys.argv) > 3 else ["eager-dynamic", "refused", "compiled"])
