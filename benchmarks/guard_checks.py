"""Host time TorchDynamo spends checking guards before each compiled token step, and what checking them at the
first step of each `generate` call only (`guards_once`, benchmarks/variants/rollout.py, an experiment) leaves of
it, on the CPU.

On an H200 at Qwen3-VL-8B shapes the check took 6.1 ms of host time per token step (`TorchDynamo Cache Lookup` in
`h200_decode_variants_stacked.md`), about 270 guards per layer. This script shows the mechanism where anyone can
run it: tiny random Qwen3-VL models (hidden 64) of a few depths with LoRA on the seven projections, the rollout's
stacked projections, decoding compiled (static cache, bucketed; dynamo with an eager backend, so only dynamo's
own host work is added), one warm-up `generate` call and then one profiled call each way. It reports the
profiler's `TorchDynamo Cache Lookup` time per token step, and the greedy tokens of both ways (they must agree).
What it is worth on a GPU, where the host and the device overlap, is for a GPU run to measure (benchmarks/NOTES.md has the one that ran).
Usage: python benchmarks/guard_checks.py OUTDIR [TOKENS]
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForImageTextToText, AutoProcessor
from variants.rollout import guards_once

from vlmrl.data.synthetic import generate_items
from vlmrl.engine.rollout.fast import (
    bucket_static_cache,
    compile_settings,
    deferred_stop_check,
    prefill_into_dynamic_cache,
)
from vlmrl.engine.rollout.finished import finished_rows_read_one_block
from vlmrl.engine.rollout.generation import encode_batch
from vlmrl.engine.rollout.stacked import StackedProjections
from vlmrl.engine.rollout.step_inputs import step_token_inputs
from vlmrl.models.tiny import build_tiny_model

DEPTHS = (2, 8)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lookup_ms(prof) -> tuple[float, int]:
    events = [e for e in prof.key_averages() if e.key == "TorchDynamo Cache Lookup"]
    return sum(e.self_cpu_time_total for e in events) / 1e3, sum(e.count for e in events)


def compiled_policy(layers: int, work: Path, prompts: int = 2, arch: str = "qwen3_vl") -> tuple:
    """(policy, its stacked projections, a prompt batch, `generate`'s compile settings): a tiny random model of
    family `arch` (a Qwen3-VL unless said; hidden 64) of `layers` layers with LoRA on the seven projections, its cache
    static and bucketed, decoding compiled with an eager backend (so only dynamo's own host work is added)."""
    path = build_tiny_model(arch, work / f"{arch}_{layers}", num_layers=layers)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    processor = AutoProcessor.from_pretrained(str(path))
    processor.tokenizer.padding_side = "left"
    items = list(generate_items(prompts, seed=3, size=128))
    batch = encode_batch(processor, [i.question for i in items], [i.image for i in items], torch.device("cpu"))
    bucket_static_cache(model, 64)
    prefill_into_dynamic_cache(model)
    policy = get_peft_model(model.eval(), LoraConfig(r=4, target_modules=TARGETS))
    settings = compile_settings(all_devices=True)
    settings["compile_config"].backend, settings["compile_config"].mode = (lambda gm, example_inputs: gm.forward), None
    return policy, StackedProjections(policy), batch, settings


@contextlib.contextmanager
def decoding_as_vlmrl(policy, stack):
    """What vlmrl's compiled generation runs `generate` inside (`vlmrl.engine.rollout.generation`): the stacked
    projections, the stop check read a step late, ended rows masked, each step's own token type ids; no grad."""
    with (stack.active(), deferred_stop_check(), finished_rows_read_one_block(policy), step_token_inputs(policy),
          torch.no_grad()):
        yield


def seeded_in_tmp(out: Path, run):
    """`run(work)`'s result, OUT made first, torch seeded, `work` a temporary folder (the tiny models' home)."""
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as work:
        return run(Path(work))


def measure(layers: int, tokens: int, work: Path) -> dict:
    policy, stack, batch, settings = compiled_policy(layers, work)
    call = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False, **settings}
    row: dict = {"layers": layers}
    for name, guards in (("every step", contextlib.nullcontext), ("first step", lambda: guards_once(policy))):
        with stack.active(), guards():
            policy.generate(**batch, **call)  # compiles (the first way) or finds the compiled entry
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                row[f"tokens {name}"] = policy.generate(**batch, **call).tolist()
        total, calls = lookup_ms(prof)
        row[name] = {"lookup_ms_per_step": total / max(calls, 1), "lookups": calls}
    row["same_tokens"] = row.pop("tokens every step") == row.pop("tokens first step")
    return row


def main(out: Path, tokens: int) -> None:
    rows = seeded_in_tmp(out, lambda work: [measure(layers, tokens, work) for layers in DEPTHS])
    (out / "guard_checks.json").write_text(json.dumps({"tokens": tokens, "rows": rows}, indent=2))
    title = (f"TorchDynamo Cache Lookup per compiled token step, tiny Qwen3-VL (hidden 64) + LoRA, {tokens} tokens, "
             f"torch {torch.__version__}, CPU")
    lines = [title, "",
             "| layers | guards every step, ms | guards at the first step of each call, ms | same tokens |",
             "|---|---|---|---|"]
    lines += [f"| {r['layers']} | {r['every step']['lookup_ms_per_step']:.3f} | "
              f"{r['first step']['lookup_ms_per_step']:.3f} | {r['same_tokens']} |" for r in rows]
    (out / "guard_checks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 24)
