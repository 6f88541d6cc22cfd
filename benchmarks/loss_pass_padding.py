"""How much of the loss pass is padding, and what skipping it (vlmrl.loss_pass) saves, on the CPU.

TRL pads a whole generation batch (prompts left, completions right, to the longest of each) and then splits it
into `steps_per_generation` micro-batches, so most micro-batches carry columns that are padding in every row.
This script builds generation batches the way TRL does, at the seed recipe's batching (8 prompts x 4 completions
per generation batch, 4 micro-batches of 8 rows), from real completion lengths, and runs TRL's own loss pass
(`GRPOTrainer._get_per_token_logps_and_entropies`, forward + backward, LoRA, gradient checkpointing) over every
micro-batch with and without the trim, alternating, in one process. It reports the share of positions that were
padding, the share the trim skipped, the loss-pass seconds both ways and the largest log-prob difference.

Completion lengths: sampled here from the demo policy (`demo-policy`, built offline on first use, about a
minute) on the demo's synthetic figures, at the training temperature; or, with `--rollouts PATH`, the `length`
of each record of a run's `train/rollouts.jsonl` (completion tokens from rollouts you ran, e.g. on a GPU), then
with random token ids. Prompts are the demo's (one 128 px figure, 16 image tokens). The seconds are the demo
policy's (4 layers, hidden 128, where the vision tower is a larger part of the pass than in an 8B model); the
padding shares depend only on the lengths and the batching.

    python benchmarks/loss_pass_padding.py OUTDIR [--rollouts PATH] [--generation-batches 4] [--repeats 3]

Left out: the old / reference log-prob passes (forward only, over the whole generation batch at once; the trim
applies there too) and any GPU timing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
import types
from collections import defaultdict
from pathlib import Path

import torch

PROMPTS, GENERATIONS, MICRO_BATCHES = 8, 4, 4  # the seed recipe: 8 x 4 completions, per_device 8, accumulation 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rollouts", type=Path, help="a run's train/rollouts.jsonl: its completion lengths")
    parser.add_argument("--generation-batches", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="sampling cap (the demo trains at 48)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmrl.models.loading import resolve_model_source

    source = resolve_model_source("demo-policy")
    processor = AutoProcessor.from_pretrained(source)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
    prompts = demo_prompts(processor, PROMPTS * args.generation_batches)
    if args.rollouts:
        lengths = [int(r["length"]) for r in map(json.loads, args.rollouts.read_text().splitlines()) if r.strip()]
        completions = [torch.randint(10, 200, (lengths[i % len(lengths)],)).tolist()
                       for i in range(len(prompts) * GENERATIONS)]
        source_note = f"{args.rollouts} ({len(lengths)} records)"
    else:
        completions = sample_completions(model, processor, prompts, args.max_new_tokens)
        source_note = f"demo-policy sampled at temperature 1, cap {args.max_new_tokens} tokens"
    batches = [micro for g in range(args.generation_batches)
               for micro in generation_batch(prompts[g * PROMPTS:(g + 1) * PROMPTS],
                                             completions[g * PROMPTS * GENERATIONS:(g + 1) * PROMPTS * GENERATIONS],
                                             processor.tokenizer.pad_token_id, seed=g)]
    result = measure(model, batches, args.repeats)
    lengths = [len(c) for c in completions]
    result |= {"completions": source_note, "completion_tokens": summary(lengths),
               "batching": f"{PROMPTS} prompts x {GENERATIONS} completions per generation batch, {MICRO_BATCHES} "
               f"micro-batches of {PROMPTS * GENERATIONS // MICRO_BATCHES} rows, {args.generation_batches} generation "
               "batches", "torch_threads": torch.get_num_threads()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loss_pass_padding.json").write_text(json.dumps(result, indent=2))
    (args.out / "loss_pass_padding.md").write_text(table(result))
    print(table(result))


def demo_prompts(processor, count: int) -> list[dict]:
    """The demo's prompts (its two synthetic families), one per row: ids, mask, pixels, grid, mm token types."""
    from vlmrl.contract import build_prompt_text
    from vlmrl.data.synthetic import generate_items
    from vlmrl.rollout.generation import render_prompt

    rows = []
    for item in generate_items(count, seed=1234, size=128, families=["count_squares", "bar_value"]):
        text = render_prompt(processor, build_prompt_text(item.question, answer_type=item.answer_type))
        rows.append(dict(processor(text=[text], images=[[item.image]], return_tensors="pt")))
    return rows


@torch.inference_mode()
def sample_completions(model, processor, prompts: list[dict], cap: int) -> list[list[int]]:
    """GENERATIONS sampled completions per prompt, up to and including the end-of-turn token (TRL's mask)."""
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    out = []
    for inputs in prompts:
        ids = model.generate(**inputs, max_new_tokens=cap, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             num_return_sequences=GENERATIONS, eos_token_id=sorted(stops),
                             pad_token_id=processor.tokenizer.pad_token_id)[:, inputs["input_ids"].shape[1]:]
        for row in ids.tolist():
            end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
            out.append(row[:end])
    return out


def generation_batch(prompts: list[dict], completions: list[list[int]], pad: int, *, seed: int) -> list[dict]:
    """TRL's layout: every prompt repeated GENERATIONS times, prompts left-padded and completions right-padded
    over the whole generation batch, rows shuffled, then split into MICRO_BATCHES micro-batches."""
    rows = [(prompts[i // GENERATIONS], completions[i]) for i in range(len(completions))]
    width_p = max(p["input_ids"].shape[1] for p, _ in rows)
    width_c = max(len(c) for _, c in rows)
    random.Random(seed).shuffle(rows)
    size = len(rows) // MICRO_BATCHES
    micro = []
    for start in range(0, len(rows), size):
        part = rows[start:start + size]
        ids, mask, mm = [], [], []
        for prompt, completion in part:
            left = width_p - prompt["input_ids"].shape[1]
            right = width_c - len(completion)
            ids.append([pad] * left + prompt["input_ids"][0].tolist() + completion + [pad] * right)
            mask.append([0] * left + [1] * (prompt["input_ids"].shape[1] + len(completion)) + [0] * right)
            mm.append([0] * left + prompt["mm_token_type_ids"][0].tolist() + [0] * width_c)
        micro.append({"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask),
                      "mm_token_type_ids": torch.tensor(mm), "logits_to_keep": width_c,
                      "pixel_values": torch.cat([p["pixel_values"] for p, _ in part]),
                      "image_grid_thw": torch.cat([p["image_grid_thw"] for p, _ in part]),
                      "num_images": [1] * len(part)})
    return micro


def measure(model, batches: list[dict], repeats: int) -> dict:
    """Loss-pass seconds untrimmed vs trimmed (alternating per micro-batch), counters and the log-prob gap."""
    import trl.trainer.utils as trl_utils
    from peft import LoraConfig, get_peft_model

    from vlmrl.bench.shaped import LORA_TARGETS
    from vlmrl.loss_pass import enable_padding_trim

    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # as GRPOTrainer.__init__ does
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))  # bench's targets
    model.train()
    plain, trimmed = stand_in(model), stand_in(model)
    counters = enable_padding_trim(trimmed)
    rounds: dict[str, list[float]] = {"untrimmed": [0.0] * repeats, "trimmed": [0.0] * repeats}
    gap = 0.0
    for repeat in range(repeats + 1):  # the first round warms up and is not timed
        if repeat == 1:  # count the timed rounds only
            counters.calls = counters.positions = counters.positions_untrimmed = counters.padding = 0
        for batch in batches:
            logps = {}
            for name, trainer in (("untrimmed", plain), ("trimmed", trimmed))[::1 if repeat % 2 else -1]:
                started = time.perf_counter()
                logps[name] = loss_pass(trainer, model, batch)
                if repeat:
                    rounds[name][repeat - 1] += time.perf_counter() - started
            mask = batch["attention_mask"][:, -batch["logits_to_keep"]:].bool()
            gap = max(gap, (logps["untrimmed"][mask] - logps["trimmed"][mask]).abs().max().item())
    trim = counters.as_dict()
    seconds = {name: sum(values) for name, values in rounds.items()}
    return {"micro_batches": len(batches), "repeats": repeats, "loss_pass_seconds": seconds,
            "seconds_per_round": {name: [round(v, 3) for v in values] for name, values in rounds.items()},
            "speedup": seconds["untrimmed"] / seconds["trimmed"], "max_log_prob_difference": gap,
            "padding_share": trim["padding_share"], "trimmed_share": trim["trimmed_share"],
            "positions_untrimmed": trim["positions_untrimmed"] // repeats, "positions": trim["positions"] // repeats}


def stand_in(model):
    """What TRL's `_get_per_token_logps_and_entropies` reads from its trainer (as tests/test_loss_pass_trim.py)."""
    from trl import GRPOTrainer

    fake = types.SimpleNamespace(model=model, state=types.SimpleNamespace(global_step=0),
                                 args=types.SimpleNamespace(report_to=[]),
                                 accelerator=types.SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True),
                                 _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    fake._get_per_token_logps_and_entropies = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, fake)
    return fake


def loss_pass(trainer, model, batch: dict) -> torch.Tensor:
    """Forward and backward of one micro-batch, as `_compute_loss` runs them (a masked sum stands in for the loss)."""
    b = dict(batch)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(
        model, b.pop("input_ids"), b.pop("attention_mask"), b.pop("logits_to_keep"), compute_entropy=True, **b)
    mask = batch["attention_mask"][:, -logps.shape[1]:]
    (logps * mask).sum().backward()
    model.zero_grad(set_to_none=True)
    return logps.detach()


def summary(values: list[int]) -> dict:
    ordered = sorted(values)
    return {"count": len(values), "min": ordered[0], "median": ordered[len(values) // 2], "max": ordered[-1],
            "mean": round(sum(values) / len(values), 1)}


def table(r: dict) -> str:
    s, c, per_round = r["loss_pass_seconds"], r["completion_tokens"], r["seconds_per_round"]
    untrimmed = ", ".join(f"{v:.2f}" for v in per_round["untrimmed"])
    trimmed = ", ".join(f"{v:.2f}" for v in per_round["trimmed"])
    notes = (f"Padding: {r['padding_share']:.1%} of the untrimmed positions; skipped: {r['trimmed_share']:.1%}. "
             f"Largest log-prob difference at a scored token: {r['max_log_prob_difference']:.1e}.\n"
             f"Completions: {r['completions']}; tokens min {c['min']}, median {c['median']}, mean {c['mean']}, "
             f"max {c['max']} ({c['count']}). Batching: {r['batching']}. CPU, {r['torch_threads']} threads.")
    return "\n".join([
        "| loss pass (TRL's, forward + backward) | untrimmed | trimmed (vlmrl.loss_pass) |",
        "|---|---|---|",
        f"| positions per round ({r['micro_batches']} micro-batches) | {r['positions_untrimmed']} | {r['positions']} |",
        f"| seconds ({r['repeats']} rounds) | {s['untrimmed']:.2f} | {s['trimmed']:.2f} ({r['speedup']:.2f}x) |",
        f"| seconds per round | {untrimmed} | {trimmed} |",
        "",
        notes,
        "",
    ])


if __name__ == "__main__":
    sys.exit(main())
