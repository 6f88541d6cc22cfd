"""The bench's figures and tables: per-path steady-state figures, ratios to plain TRL, markdown for bench.md.

`summarize` turns the raw per-step records of each path into steady-state figures (the first, compiling step
excluded when there are more) next to the floors; `markdown_table` writes bench.md (`rollouts_per_step`: how a step's completions
are split into rollouts); `scaling_table` compares one GPU with N. Pure bookkeeping (tested on the CPU); left out: anything that runs a model (`run`).
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from vlmrl.bench.floors import decode_floor_ms, ragged_decode_floor_ms, train_floor_s
from vlmrl.bench.ragged import draw_lengths
from vlmrl.bench.shaped import BenchSettings, batching
from vlmrl.common.provenance import package_version
from vlmrl.preflight.memory import kv_bytes_per_token, language_param_count


def ratio_prefix(path: str) -> str:
    """The prefix of a path's ratios to plain TRL: its name less "vlmrl-", with "_" for "-".

    >>> ratio_prefix("vlmrl"), ratio_prefix("vlmrl-filled-copies"), ratio_prefix("unsloth")
    ('', 'filled_copies_', 'unsloth_')
    """
    name = path.removeprefix("vlmrl").removeprefix("-").replace("-", "_")
    return f"{name}_" if name else ""


def ratio_prefixes(paths: list[str] | dict) -> dict[str, str]:
    """The ratio prefix of each path that ran, plain TRL (the reference) left out."""
    return {path: ratio_prefix(path) for path in paths if path != "plain"}


def steady_steps(steps: list[dict], warmup: int) -> list[dict]:
    """The steps a path's steady figures average: those after the first `warmup`; for a path that ran no more than
    that, all but the first (a single step stands for itself: plain TRL compiles nothing)."""
    if len(steps) > warmup:
        return steps[warmup:]
    return steps[1:] if len(steps) > 1 else steps


def rollouts_per_step(settings: dict) -> tuple[int, int]:
    """(rollouts per optimizer step, completions per rollout) for a bench's settings (as a dict): a micro-step of
    `micro_batch` completions, `steps_per_generation` micro-steps per rollout (TRL's default: all of the step's).
    A rollout that spans several optimizer steps counts as one per step."""
    micro, accumulation = batching(settings)
    rows = micro * (settings.get("steps_per_generation") or accumulation)
    return max(1, micro * accumulation // rows), rows


def completion_lengths(settings: BenchSettings) -> list[int]:
    """Each completion's length in one optimizer step: the cap (forced), or each rollout's drawn lengths
    (`vlmrl.bench.ragged`; every rollout draws the same)."""
    if not settings.ragged_median:
        return [settings.completion] * (settings.prompts * settings.generations)
    rollouts, rows = rollouts_per_step(asdict(settings))
    return draw_lengths(rows, settings.ragged_median, settings.completion) * rollouts


def summarize(settings: BenchSettings, shapes: dict, ceilings: dict, results: list[dict], prompt_tokens: int) -> dict:
    """Per-path steady-state figures (first step excluded when there are more) and the floors."""
    text = shapes["text_config"]
    batch = settings.prompts * settings.generations
    language = language_param_count(text)
    weight_bytes = language * (0.5 if settings.load_in_4bit else 2)
    bandwidth = ceilings["copy_bandwidth_tbs"] * 1e12
    kv = kv_bytes_per_token(text)
    lengths = completion_lengths(settings)
    token_steps = max(lengths)  # a rollout runs until its longest row ends
    tokens = sum(prompt_tokens + n for n in lengths)
    floors = {
        "decode_ms_per_step": (ragged_decode_floor_ms(weight_bytes, kv, prompt_tokens, lengths, bandwidth)
                               if settings.ragged_median else
                               decode_floor_ms(weight_bytes, kv, batch, prompt_tokens, settings.completion, bandwidth)),
        "train_seconds_per_step": train_floor_s(language, tokens, ceilings["matmul_tflops"] * 1e12),
    }
    if settings.ragged_median:  # an engine that keeps reading the finished rows' cache until the rollout ends
        floors["decode_ms_per_step_all_rows"] = decode_floor_ms(weight_bytes, kv, len(lengths), prompt_tokens,
                                                                token_steps, bandwidth)
    floors["step_seconds"] = floors["decode_ms_per_step"] * token_steps / 1e3 + floors["train_seconds_per_step"]
    paths = {}
    for r in results:
        unprofiled = [s for s in r["steps"] if not s.get("profiled")]  # a profiled step is slower (vlmrl.bench.comm)
        steps = steady_steps(unprofiled, settings.warmup_steps)
        if not steps:
            paths[r["path"]] = {"error": r["error"] or "no step completed"}
            continue
        step = sum(s["seconds"] for s in steps) / len(steps)
        gen = sum(s["generate_seconds"] for s in steps) / len(steps)
        world = r.get("world_size", 1)
        paths[r["path"]] = {
            "error": r["error"],
            "world_size": world,
            "samples_per_second": batch * world / step,
            "first_step_seconds": r["steps"][0]["seconds"],
            "step_seconds": step,
            "generate_seconds": gen,
            "decode_ms_per_step": 1e3 * gen / token_steps,
            "decode_tokens_per_second": sum(lengths) / gen if gen else None,
            # ragged: did every rollout end its rows at the drawn lengths? (None: forced, or not recorded)
            "lengths_as_drawn": (all(r == lengths[:len(r)] for s in steps for r in s["rollout_lengths"])
                                 if settings.ragged_median and all("rollout_lengths" in s for s in steps) else None),
            "train_tokens_per_second": tokens / (step - gen) if step > gen else None,
            "peak_memory_gib": r["peak_memory_gib"],
            "generation_peak_gib": r.get("generation_peak_gib"),
            "training_peak_gib": r.get("training_peak_gib"),
            "peak_memory_gib_per_rank": r.get("peak_memory_gib_per_rank", [r["peak_memory_gib"]]),
            "peak_reserved_gib": r["peak_reserved_gib"],
            "steps_measured": len(steps),
            "steps_set_apart": len(unprofiled) - len(steps),
            "communication_per_rank": r.get("communication_per_rank"),
            # plain compiles nothing; when it ran a single step that step is its steady one, compilation-free
            "first_step_excluded": len(r["steps"]) > 1,
            "fast_generation": r["fast_generation"],
            # functions dynamo stopped compiling during the path's training (vlmrl.engine.recompiles)
            "recompile_limit_hits": r.get("recompile_limit_hits") or [],
            "loss_pass": r.get("loss_pass"),
            "lora_modules": r.get("lora_modules"),
            # set for a path run in its own process (unsloth): its own package versions
            "versions": r.get("versions"),
            "imported_before_unsloth": r.get("imported_before_unsloth"),
        }
    ratios = {}
    for name, prefix in ratio_prefixes(paths).items():
        if "step_seconds" in paths.get("plain", {}) and "step_seconds" in paths.get(name, {}):
            p, v = paths["plain"], paths[name]
            ratios.update({
                f"{prefix}step_speedup": p["step_seconds"] / v["step_seconds"],
                f"{prefix}decode_speedup": p["decode_ms_per_step"] / v["decode_ms_per_step"],
                f"{prefix}vlmrl_decode_vs_floor": v["decode_ms_per_step"] / floors["decode_ms_per_step"],
                f"{prefix}peak_memory_ratio": v["peak_memory_gib"] / p["peak_memory_gib"],
            })
    if "step_seconds" in paths.get("vlmrl", {}) and "step_seconds" in paths.get("unsloth", {}):
        v, u = paths["vlmrl"], paths["unsloth"]
        ratios["vlmrl_vs_unsloth_step_speedup"] = u["step_seconds"] / v["step_seconds"]
        ratios["vlmrl_vs_unsloth_decode_speedup"] = u["decode_ms_per_step"] / v["decode_ms_per_step"]
        ratios["vlmrl_vs_unsloth_peak_memory_ratio"] = v["peak_memory_gib"] / u["peak_memory_gib"]
    return {
        "settings": asdict(settings),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "versions": versions(),
        "ceilings": ceilings,
        "prompt_tokens": prompt_tokens,
        "language_params": language,
        "floors": floors,
        "ragged": ({"median": settings.ragged_median, "cap": settings.completion, "mean_length": sum(lengths) / len(lengths),
                    "token_steps": token_steps, "useful_fraction": sum(lengths) / (len(lengths) * token_steps)}
                   if settings.ragged_median else None),
        "paths": paths,
        "ratios": ratios,
        "raw": results,
    }


# What each fast path ran, as the markdown table names it (fields of `FastGeneration`; `merge` and `guards` are
# the variants' own, benchmarks/variants/rollout.py; absent in older records).
SETTING_LABELS = (("attention ", "attention"), ("autocast ", "autocast"), ("prompt pass: ", "prefill"),
                  ("adapter: ", "merge"), ("adapter weights: ", "adapters"), ("stop check: ", "stop_check"),
                  ("attention reads ", "cache_read"), ("guards checked: ", "guards"), ("4-bit weights: ", "weights"),
                  ("token steps: ", "step_graph"))


def markdown_table(summary: dict) -> str:
    s = summary["settings"]
    lines = [
        f"Device: {summary['device']}; shapes {s['shapes']}; {s['prompts']} prompts x {s['generations']} generations, "
        f"{completion_words(summary)}, prompt {summary['prompt_tokens']} tokens, LoRA r={s['lora_r']}, "
        f"{s['algorithm'].upper()}, {'4-bit, ' if s['load_in_4bit'] else ''}{s.get('dtype', 'bfloat16')}"
        + (f", {s['micro_batch']} completions per micro-step" if s.get("micro_batch") else "")
        + (f", {s['steps_per_generation']} micro-steps per rollout" if s.get("steps_per_generation") else "")
        + (f", memory capped at {s['memory_cap_gib']} GiB" if s["memory_cap_gib"] else "")
        + (", a third reward that varies (--varied-reward)" if s.get("varied_reward") else ""),
        "",
        ("| path | step s | first step s | generate s | decode ms/step | decode tok/s | train tok/s | peak GiB "
         "| peak in rollouts / rest GiB | GPUs | samples/s |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in summary["paths"].items():
        if "step_seconds" not in p:
            lines.append(f"| {name} | failed: {p['error']} | | | | | | | | | |")
            continue
        phases = (f"{p['generation_peak_gib']:.1f} / {p['training_peak_gib']:.1f}"
                  if p.get("generation_peak_gib") is not None else "")
        lines.append(
            f"| {name} | {p['step_seconds']:.1f} | {p['first_step_seconds']:.1f} | {p['generate_seconds']:.1f} | "
            f"{p['decode_ms_per_step']:.1f} | {p['decode_tokens_per_second'] or 0:.0f} | "
            f"{p['train_tokens_per_second'] or 0:.0f} | {p['peak_memory_gib']:.1f} | {phases} | "
            f"{p.get('world_size', 1)} | {p.get('samples_per_second', 0):.2f} |"
        )
    f = summary["floors"]
    lines.append(f"| floor | {f['step_seconds']:.1f} | | | {f['decode_ms_per_step']:.1f} | | | | | | |")
    c = summary["ceilings"]
    kv_read = ("the KV cache of the rows still generating" if summary.get("ragged") else "mean KV cache")
    lines += ["", (f"Ceilings measured in this run: {c['matmul_tflops']:.0f} TFLOP/s bf16 matmul, "
                   f"{c['copy_bandwidth_tbs']:.2f} TB/s device copy. Floors: decode = (weights + {kv_read}) / "
                   f"bandwidth; training = 6 x {summary['language_params'] / 1e9:.2f}B language parameters x tokens / "
                   "matmul rate.")]
    if summary.get("ragged"):
        drawn = {name: p["lengths_as_drawn"] for name, p in summary["paths"].items() if "lengths_as_drawn" in p}
        lines.append(f"Reading every row's cache until the rollout ends, the decode floor is "
                     f"{f['decode_ms_per_step_all_rows']:.1f} ms. Completions ended at the drawn lengths: "
                     + ", ".join(f"{name} {'yes' if ok else 'no' if ok is False else 'not recorded'}"
                                 for name, ok in drawn.items()) + ".")
    rollouts, rows = rollouts_per_step(s)
    if rollouts > 1:
        each = ", ".join(f"{name} {p['decode_ms_per_step'] / rollouts:.1f} ms" for name, p in summary["paths"].items()
                         if "decode_ms_per_step" in p)
        lines.append(f"Each optimizer step generates {rollouts} rollouts of {rows} completions, so decode ms/step sums "
                     f"{rollouts} token steps: per token step of {rows} rows {each}. The decode floor is for one "
                     f"rollout of all {rollouts * rows}.")
    if cache := summary.get("compile_cache"):
        lines.append(f"Compile cache {cache['inductor_dir']}: {'cold (empty)' if cache['cold'] else 'warm'} at the "
                     f"start ({cache['files_at_start']} files); the first step column includes compilation.")
    for name, p in summary["paths"].items():
        for hit in p.get("recompile_limit_hits") or []:
            lines.append(f"**{name}: dynamo hit its {hit['limit']} compiling `{hit['function']}` and ran it eagerly "
                         f"after that** (last recompile: `{hit['reason']}`): this path's figures are not those of "
                         "its compiled steps.")
    apart = {name: p["steps_set_apart"] for name, p in summary["paths"].items() if "steps_set_apart" in p}
    if any(n > 1 for n in apart.values()):
        lines.append("Steps set apart before the steady columns (the first step column is the first of them): "
                     + ", ".join(f"{name} {n}" for name, n in apart.items()) + ".")
    r = summary["ratios"]
    for name, prefix in ratio_prefixes(summary["paths"]).items():
        if f"{prefix}step_speedup" in r:
            lines.append(f"Ratios, {name} vs plain: step {r[prefix + 'step_speedup']:.2f}x faster, decode "
                         f"{r[prefix + 'decode_speedup']:.2f}x faster, decode {r[prefix + 'vlmrl_decode_vs_floor']:.2f}x "
                         f"the floor, peak memory {r[prefix + 'peak_memory_ratio']:.2f}x plain.")
    if "vlmrl_vs_unsloth_step_speedup" in r:
        lines.append(f"Ratios, vlmrl vs unsloth: step {r['vlmrl_vs_unsloth_step_speedup']:.2f}x faster, decode "
                     f"{r['vlmrl_vs_unsloth_decode_speedup']:.2f}x faster, peak memory "
                     f"{r['vlmrl_vs_unsloth_peak_memory_ratio']:.2f}x unsloth's.")
    for name, p in summary["paths"].items():  # a path run in its own process ran its own versions
        if p.get("versions"):
            ran = ", ".join(f"{k} {v}" for k, v in p["versions"].items() if v)
            lines.append(f"{name}: its own process ({ran}); LoRA layers {p.get('lora_modules')}; imported before "
                         f"unsloth: {', '.join(p.get('imported_before_unsloth') or []) or 'nothing it patches'}.")
    for name, p in summary["paths"].items():  # what each fast path ran, as recorded when it was set up
        fast = p.get("fast_generation") or {}
        if fast.get("enabled"):
            ran = [f"{label}{fast[key]}" for label, key in SETTING_LABELS if fast.get(key) is not None]
            kernels = (p.get("loss_pass") or {}).get("kernels")
            lines.append(f"{name}: {', '.join(ran)}" + (f"; loss pass kernels: {kernels}" if kernels else "") + ".")
    return "\n".join(lines) + "\n"


def completion_words(summary: dict) -> str:
    """How long the completions were, as the table's first line says it."""
    s, ragged = summary["settings"], summary.get("ragged")
    if not ragged:
        return f"completion {s['completion']} tokens (forced)"
    return (f"completions ragged (median {ragged['median']}, a tenth at the {ragged['cap']}-token cap: mean "
            f"{ragged['mean_length']:.0f} tokens, {ragged['token_steps']} token steps per rollout, "
            f"{ragged['useful_fraction']:.0%} of the rows' steps generating)")


def scaling_table(one: dict, many: dict, path: str = "vlmrl") -> tuple[str, dict]:
    """Markdown and figures for the same bench on 1 GPU and on N GPUs (same per-GPU batch)."""
    a, b = one["paths"][path], many["paths"][path]
    figures = {
        "gpus": [a["world_size"], b["world_size"]],
        "samples_per_second": [a["samples_per_second"], b["samples_per_second"]],
        "speedup": b["samples_per_second"] / a["samples_per_second"],
        "peak_memory_gib_per_gpu": [a["peak_memory_gib_per_rank"], b["peak_memory_gib_per_rank"]],
    }
    lines = ["| GPUs | step s | samples/s | peak GiB per GPU |", "|---|---|---|---|"]
    for p in (a, b):
        peaks = ", ".join(f"{x:.1f}" for x in p["peak_memory_gib_per_rank"])
        lines.append(f"| {p['world_size']} | {p['step_seconds']:.1f} | {p['samples_per_second']:.2f} | {peaks} |")
    lines.append("")
    lines.append(f"Samples per second on {b['world_size']} GPUs: {figures['speedup']:.2f}x one GPU.")
    return "\n".join(lines) + "\n", figures


def versions() -> dict:
    """The versions a bench record ran with."""
    return {name: package_version(name) for name in ("torch", "transformers", "trl", "peft", "bitsandbytes")}
