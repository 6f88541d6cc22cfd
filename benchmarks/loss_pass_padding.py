"""How much of the loss pass is padding, and what skipping it (vlmrl.engine.loss.loss_pass) saves, on the CPU.

TRL pads a whole generation batch (prompts left, completions right, to the longest of each) and then splits it
into `steps_per_generation` micro-batches, so most micro-batches carry columns that are padding in every row.
This script builds generation batches the way TRL does, at the seed recipe's batching (8 prompts x 4 completions
per generation batch, 4 micro-batches of 8 rows), from completion lengths, and runs TRL's own loss pass
(`GRPOTrainer._get_per_token_logps_and_entropies`, forward + backward, LoRA, gradient checkpointing) over every
micro-batch three ways, rotating their order, in one process: untrimmed with TRL's random grouping, trimmed with
TRL's random grouping, and trimmed with length-grouped micro-batches (`vlmrl.engine.loss.loss_pass.length_order`, what
`train.group_by_length` does). It reports the share of positions that were padding, the share each trimmed pass
skipped, the loss-pass seconds and the largest log-prob difference from the untrimmed pass at a scored token.

Two sets of completion lengths, each in its own table:
- demo: sampled here from the demo policy (`demo-policy`, built offline on first use, about a minute) on the demo's
  synthetic figures, at the training temperature (short: it was trained to answer in a few tokens).
- wide: with `--rollouts PATH`, the `length` of each record of a run's `train/rollouts.jsonl` (e.g. a GPU run's);
  otherwise synthetic, since no run recorded so far has lengths spread over hundreds of tokens (the GPU records
  force full-length completions with `min_new_tokens`; the demo runs answer in 1 to 48 tokens): log-normal with
  median `--wide-median` tokens, half of the log-spread shared by a prompt's 4 completions (a hard prompt makes
  all of them long), clipped to 50 and to the 1024-token cap (a completion at the cap is a truncated one).
  Completion token ids are random there.
Prompts are the demo's (one 128 px figure, 16 image tokens). The seconds are the demo policy's (4 layers, hidden
128, where the vision tower is a larger part of the pass than in an 8B model); the padding shares depend only on
the lengths and the batching.

    python benchmarks/loss_pass_padding.py OUTDIR [--rollouts PATH] [--generation-batches 4]
        [--wide-generation-batches 2] [--wide-median 300] [--repeats 3]

Left out: the old / reference log-prob passes (forward only, over the whole generation batch at once; the trim
applies there too, the grouping does not change them) and any GPU timing.
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
CAP = 1024  # the seed recipe's max_completion_length: the wide lengths' cap
VARIANTS = ("untrimmed", "trimmed", "grouped")  # TRL's pass; trimmed, TRL's random grouping; trimmed, length-grouped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rollouts", type=Path, help="a run's train/rollouts.jsonl: the wide set's lengths")
    parser.add_argument("--generation-batches", type=int, default=4, help="of the demo lengths")
    parser.add_argument("--wide-generation-batches", type=int, default=2)
    parser.add_argument("--wide-median", type=int, default=300, help="synthetic wide lengths: median tokens")
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
    pad = processor.tokenizer.pad_token_id
    sets = {}
    prompts = demo_prompts(processor, PROMPTS * args.generation_batches)
    completions = sample_completions(model, processor, prompts, args.max_new_tokens)
    sets["demo"] = (prompts, completions, f"demo-policy sampled at temperature 1, cap {args.max_new_tokens} tokens")
    wide_prompts = prompts[:PROMPTS * args.wide_generation_batches]
    if len(wide_prompts) < PROMPTS * args.wide_generation_batches:
        wide_prompts = demo_prompts(processor, PROMPTS * args.wide_generation_batches)
    rows = len(wide_prompts) * GENERATIONS
    if args.rollouts:
        lengths = [int(r["length"]) for r in map(json.loads, args.rollouts.read_text().splitlines()) if r.strip()]
        lengths = [lengths[i % len(lengths)] for i in range(rows)]
        note = f"{args.rollouts} ({len(lengths)} records)"
    else:
        lengths = wide_lengths(rows, args.wide_median)
        note = (f"synthetic: log-normal, median {args.wide_median}, half the log-spread shared per prompt, "
                f"clipped to 50-{CAP}")
    sets["wide"] = (wide_prompts, [torch.randint(10, 200, (n,)).tolist() for n in lengths], note)
    prepared = prepare(model)
    result = {"torch_threads": torch.get_num_threads(), "repeats": args.repeats}
    for name, (set_prompts, set_completions, set_note) in sets.items():
        batches = {order: [micro for g in range(len(set_prompts) // PROMPTS)
                           for micro in generation_batch(set_prompts[g * PROMPTS:(g + 1) * PROMPTS],
                                                         set_completions[g * PROMPTS * GENERATIONS:
                                                                         (g + 1) * PROMPTS * GENERATIONS],
                                                         pad, seed=g, order=order)]
                   for order in ("random", "length")}
        result[name] = measure(prepared, batches, args.repeats) | {
            "completions": set_note, "completion_tokens": summary([len(c) for c in set_completions]),
            "batching": f"{PROMPTS} prompts x {GENERATIONS} completions per generation batch, {MICRO_BATCHES} "
            f"micro-batches of {PROMPTS * GENERATIONS // MICRO_BATCHES} rows, {len(set_prompts) // PROMPTS} "
            "generation batches"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loss_pass_padding.json").write_text(json.dumps(result, indent=2))
    (args.out / "loss_pass_padding.md").write_text(table(result))
    print(table(result))


def wide_lengths(rows: int, median: int) -> list[int]:
    """Synthetic completion lengths spread over hundreds of tokens (see the module docstring), seeded."""
    g = torch.Generator().manual_seed(21)
    shared = torch.randn(rows // GENERATIONS, generator=g).repeat_interleave(GENERATIONS)
    own = torch.randn(rows, generator=g)
    spread = 0.8 / 2 ** 0.5  # each half of a log-normal sigma of 0.8
    lengths = median * torch.exp(spread * (shared + own))
    return lengths.round().clamp(50, CAP).long().tolist()


def demo_prompts(processor, count: int) -> list[dict]:
    """The demo's prompts (its two synthetic families), one per row: ids, mask, pixels, grid, mm token types."""
    from vlmrl.contract import build_prompt_text
    from vlmrl.data.synthetic import generate_items
    from vlmrl.engine.rollout.generation import render_prompt

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


def generation_batch(prompts: list[dict], completions: list[list[int]], pad: int, *, seed: int,
                     order: str) -> list[dict]:
    """TRL's layout: every prompt repeated GENERATIONS times, prompts left-padded and completions right-padded
    over the whole generation batch, rows shuffled (`order="random"`) or the same shuffle sorted by length as
    `train.group_by_length` does (`order="length"`), then split into MICRO_BATCHES micro-batches."""
    from vlmrl.engine.loss.loss_pass import length_order

    rows = [(i, prompts[i // GENERATIONS], completions[i]) for i in range(len(completions))]
    width_p = max(p["input_ids"].shape[1] for _, p, _ in rows)
    width_c = max(len(c) for _, _, c in rows)
    random.Random(seed).shuffle(rows)
    if order == "length":
        keys = [torch.tensor([len(c) for _, _, c in rows]), torch.tensor([p["input_ids"].shape[1] for _, p, _ in rows])]
        rows = [rows[i] for i in length_order(*keys, torch.arange(len(rows))).tolist()]
    size = len(rows) // MICRO_BATCHES
    micro = []
    for start in range(0, len(rows), size):
        part = rows[start:start + size]
        ids, mask, mm = [], [], []
        for _, prompt, completion in part:
            left = width_p - prompt["input_ids"].shape[1]
            right = width_c - len(completion)
            ids.append([pad] * left + prompt["input_ids"][0].tolist() + completion + [pad] * right)
            mask.append([0] * left + [1] * (prompt["input_ids"].shape[1] + len(completion)) + [0] * right)
            mm.append([0] * left + prompt["mm_token_type_ids"][0].tolist() + [0] * width_c)
        micro.append({"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask),
                      "mm_token_type_ids": torch.tensor(mm), "logits_to_keep": width_c,
                      "pixel_values": torch.cat([p["pixel_values"] for _, p, _ in part]),
                      "image_grid_thw": torch.cat([p["image_grid_thw"] for _, p, _ in part]),
                      "num_images": [1] * len(part), "rows": [i for i, _, _ in part]})
    return micro


def prepare(model):
    """The loss pass's model as the trainer holds it: TRL's fused head, gradient checkpointing, bench's LoRA."""
    import trl.trainer.utils as trl_utils
    from peft import LoraConfig, get_peft_model

    from vlmrl.bench.shaped import LORA_TARGETS

    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # as GRPOTrainer.__init__ does
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))  # bench's targets
    model.train()
    return model


def measure(model, batches: dict[str, list[dict]], repeats: int) -> dict:
    """Loss-pass seconds of the three VARIANTS (their order rotating per round; round 0 warms up, untimed),
    the trims' counters and the largest log-prob gap to the untrimmed pass, row by row."""
    from vlmrl.engine.loss.loss_pass import enable_padding_trim

    trainers = {name: stand_in(model) for name in VARIANTS}
    counters = {name: enable_padding_trim(trainers[name]) for name in VARIANTS[1:]}
    runs = {"untrimmed": batches["random"], "trimmed": batches["random"], "grouped": batches["length"]}
    rounds = {name: [0.0] * repeats for name in VARIANTS}
    logps: dict[str, dict[int, torch.Tensor]] = {name: {} for name in VARIANTS}
    for repeat in range(repeats + 1):
        if repeat == 1:  # count the timed rounds only
            for c in counters.values():
                c.calls = c.positions = c.positions_untrimmed = c.padding = 0
        for name in VARIANTS[repeat % 3:] + VARIANTS[:repeat % 3]:
            started = time.perf_counter()
            for batch in runs[name]:
                out = loss_pass(trainers[name], model, batch)
                if repeat == 0:
                    lengths = batch["attention_mask"][:, -batch["logits_to_keep"]:].sum(1).tolist()
                    logps[name].update({row: out[j, :n] for j, (row, n) in enumerate(zip(batch["rows"], lengths))})
            if repeat:
                rounds[name][repeat - 1] = time.perf_counter() - started
    gaps = {name: max((logps[name][row] - logps["untrimmed"][row]).abs().max().item() for row in logps[name])
            for name in VARIANTS[1:]}
    seconds = {name: sum(values) for name, values in rounds.items()}
    trims = {name: c.as_dict() for name, c in counters.items()}
    return {"micro_batches": len(batches["random"]), "loss_pass_seconds": seconds,
            "seconds_per_round": {name: [round(v, 3) for v in values] for name, values in rounds.items()},
            "speedup": {name: seconds["untrimmed"] / seconds[name] for name in VARIANTS[1:]},
            "max_log_prob_difference": gaps, "padding_share": trims["trimmed"]["padding_share"],
            "trimmed_share": {name: t["trimmed_share"] for name, t in trims.items()},
            "positions_untrimmed": trims["trimmed"]["positions_untrimmed"] // repeats,
            "positions": {name: t["positions"] // repeats for name, t in trims.items()}}


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
    b = {k: v for k, v in batch.items() if k != "rows"}
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


def table(result: dict) -> str:
    parts = []
    for name, title in (("demo", "the demo policy's lengths"), ("wide", "lengths over hundreds of tokens")):
        r = result[name]
        s, c, per_round, positions = r["loss_pass_seconds"], r["completion_tokens"], r["seconds_per_round"], r["positions"]
        rounds = {v: ", ".join(f"{x:.2f}" for x in per_round[v]) for v in VARIANTS}
        parts += [
            (f"**{name}: {title}.** Completions: {r['completions']}; tokens min {c['min']}, median {c['median']}, "
             f"mean {c['mean']}, max {c['max']} ({c['count']}). {r['batching']}."),
            "",
            ("| loss pass (TRL's, forward + backward) | untrimmed | trimmed, TRL's random grouping | trimmed, "
             "length-grouped |"),
            "|---|---|---|---|",
            (f"| positions per round ({r['micro_batches']} micro-batches) | {r['positions_untrimmed']} | "
             f"{positions['trimmed']} | {positions['grouped']} |"),
            (f"| positions skipped (padding: {r['padding_share']:.1%}) | 0 | {r['trimmed_share']['trimmed']:.1%} | "
             f"{r['trimmed_share']['grouped']:.1%} |"),
            (f"| seconds ({result['repeats']} rounds) | {s['untrimmed']:.2f} | {s['trimmed']:.2f} "
             f"({r['speedup']['trimmed']:.2f}x) | {s['grouped']:.2f} ({r['speedup']['grouped']:.2f}x) |"),
            f"| seconds per round | {rounds['untrimmed']} | {rounds['trimmed']} | {rounds['grouped']} |",
            (f"| largest log-prob difference to untrimmed | - | {r['max_log_prob_difference']['trimmed']:.1e} | "
             f"{r['max_log_prob_difference']['grouped']:.1e} |"),
            "",
        ]
    parts.append(f"CPU, {result['torch_threads']} threads; the three passes alternate in order round by round.")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.exit(main())
