"""The seed recipe's loss pass with and without Liger's fused kernels (`vlmrl.engine.loss.kernels`), side by side in one
process on one GPU. CUDA only.

Builds Qwen3-VL-8B's shapes with random bf16 weights (what `vlmrl bench` trains), LoRA r=16 on the language
projections (float32 adapters, bf16 inputs under autocast as `vlmrl train` runs them), TRL's fused log-prob head
and gradient checkpointing, then runs TRL's own loss pass (`GRPOTrainer._get_per_token_logps_and_entropies`,
forward + backward of a masked sum) over one optimizer step's micro-batches (4 x 8 rows of one 512 px figure's
prompt and 1,024 completion tokens, no padding: the record's forced lengths) under bf16 autocast, two ways,
alternating which goes first, round by round: the modules' own forwards, and Liger's kernels installed. Reports
seconds per round, the floor (6 x language parameters x tokens at the matmul rate measured here), peak memory,
and the largest differences in log-probs and LoRA gradients between the two.

With `--numerics`: how far each bf16 variant is from the same pass in float32 (the model's weights cast up, no
autocast, the modules' own forwards) over one micro-batch: log-probs at every completion token and the LoRA
gradients. Liger's kernels should be no farther from it than the modules' own bf16 forwards.

    python benchmarks/loss_pass_kernels.py OUTDIR [--rounds 3] [--numerics]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

MICRO_BATCHES, ROWS, COMPLETION = 4, 8, 1024
VARIANTS = ("own", "liger")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--numerics", action="store_true", help="errors against float32 instead of seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("loss_pass_kernels.py measures a GPU: no CUDA device here")
    from vlmrl.bench.floors import measure_ceilings, train_floor_s
    from vlmrl.bench.shaped import build_processor, build_shaped_model, load_shapes
    from vlmrl.engine.loss import kernels as loss_kernels
    from vlmrl.preflight.memory import language_param_count

    missing = loss_kernels.liger_missing()
    if missing:
        sys.exit(f"Liger's kernels cannot run: {missing}")
    ceilings = None if args.numerics else measure_ceilings()  # the floor's matmul rate, before the model is built
    shapes = load_shapes("qwen3_vl_8b")
    work = Path(tempfile.mkdtemp(prefix="vlmrl-loss-kernels-"))
    processor_dir = build_processor(work, 512)
    model = prepare(build_shaped_model(shapes, processor_dir, load_in_4bit=False, work=work))
    batch = micro_batch(processor_dir)
    from loss_pass_padding import stand_in  # the script beside this one (benchmarks/ is the script's folder)

    trainer = stand_in(model)
    if args.numerics:
        return numerics(args.out, model, trainer, batch)
    tokens = MICRO_BATCHES * batch["input_ids"].numel()
    floor = train_floor_s(language_param_count(shapes["text_config"]), tokens, ceilings["matmul_tflops"] * 1e12)
    seconds = {v: [] for v in VARIANTS}
    peaks = {v: 0.0 for v in VARIANTS}
    logps: dict[str, torch.Tensor] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    counts = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up (Triton compiles Liger's kernels), untimed
        for variant in VARIANTS[round_ % 2:] + VARIANTS[:round_ % 2]:
            if variant == "liger":
                counts = loss_kernels.install(model.get_base_model())
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            for _ in range(MICRO_BATCHES):
                out = loss_pass(trainer, model, batch)
            torch.cuda.synchronize()
            if round_:
                seconds[variant].append(time.perf_counter() - started)
                peaks[variant] = max(peaks[variant], torch.cuda.max_memory_allocated() / 2**30)
            else:
                logps[variant] = out.float()
                grads[variant] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            loss_kernels.uninstall(model.get_base_model())
    grad_gap = max(((grads["liger"][n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in grads["own"].items())
    result = {
        "device": torch.cuda.get_device_name(), "shapes": "qwen3_vl_8b", "rounds": args.rounds,
        "micro_batches": MICRO_BATCHES, "rows": ROWS, "tokens_per_row": batch["input_ids"].shape[1],
        "completion": COMPLETION, "tokens_per_round": tokens, "ceilings": ceilings, "floor_s": floor,
        "seconds_per_round": {v: [round(s, 3) for s in seconds[v]] for v in VARIANTS},
        "mean_s": {v: sum(seconds[v]) / len(seconds[v]) for v in VARIANTS},
        "peak_gib": peaks, "installed": counts,
        "max_log_prob_difference": (logps["liger"] - logps["own"]).abs().max().item(),
        "max_relative_lora_grad_difference": grad_gap, "lora_grads_compared": len(grads["own"]),
    }
    result["floor_ratio"] = {v: result["mean_s"][v] / floor for v in VARIANTS}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loss_pass_kernels.json").write_text(json.dumps(result, indent=2))
    (args.out / "loss_pass_kernels.md").write_text(table(result))
    print(table(result))


def numerics(out: Path, model, trainer, batch: dict) -> None:
    """Each bf16 variant's distance from the float32 pass (see the module docstring)."""
    from vlmrl.engine.loss import kernels as loss_kernels

    results = {}
    for variant in VARIANTS:
        if variant == "liger":
            loss_kernels.install(model.get_base_model())
        logps = loss_pass(trainer, model, batch).float()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        loss_kernels.uninstall(model.get_base_model())
        results[variant] = (logps, grads)
    model.float()  # the bf16 base weights cast up exactly; the LoRA weights are float32 already
    ref_logps = loss_pass(trainer, model, batch, autocast=False).float()
    ref_grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    report = {"device": torch.cuda.get_device_name(), "rows": ROWS, "tokens_per_row": batch["input_ids"].shape[1],
              "completion": COMPLETION, "lora_grads_compared": len(ref_grads)}
    for variant, (logps, grads) in results.items():
        gap = (logps - ref_logps).abs()
        rel = [((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in ref_grads.items()]
        report[variant] = {"max_log_prob_error": gap.max().item(), "mean_log_prob_error": gap.mean().item(),
                           "max_relative_lora_grad_error": max(rel), "mean_relative_lora_grad_error": sum(rel) / len(rel)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_pass_kernels_numerics.json").write_text(json.dumps(report, indent=2))
    lines = [(f"Errors against the same pass in float32 ({report['device']}; {ROWS} rows x {report['tokens_per_row']} "
              f"tokens, {COMPLETION} completion; {report['lora_grads_compared']} LoRA gradients)"), "",
             "| bf16 loss pass | log-prob error, max | mean | LoRA gradient relative error, max | mean |",
             "|---|---|---|---|---|"]
    for variant, name in (("own", "the modules' own forwards"), ("liger", "Liger's kernels")):
        r = report[variant]
        lines.append(f"| {name} | {r['max_log_prob_error']:.2e} | {r['mean_log_prob_error']:.2e} | "
                     f"{r['max_relative_lora_grad_error']:.2e} | {r['mean_relative_lora_grad_error']:.2e} |")
    (out / "loss_pass_kernels_numerics.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def prepare(model):
    """The loss pass's model as `vlmrl train` holds it: TRL's fused head, checkpointing, LoRA on the language
    projections (float32 adapters over the bf16 base), inputs kept in bf16 under autocast."""
    import trl.trainer.utils as trl_utils
    from peft import LoraConfig, get_peft_model

    from vlmrl.bench.shaped import LORA_TARGETS
    from vlmrl.engine.loss.adapter_inputs import keep_inputs_under_autocast

    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # as GRPOTrainer.__init__ does
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()
            torch.nn.init.normal_(p, std=0.02)  # PEFT starts B at zero; random B makes every gradient nonzero
    keep_inputs_under_autocast(model, "cuda")
    model.train()
    return model


def micro_batch(processor_dir: Path) -> dict:
    """ROWS copies of one prompt (a synthetic 512 px figure and its question) followed by COMPLETION random tokens."""
    from transformers import AutoProcessor

    from vlmrl.contract import build_prompt_text
    from vlmrl.data.synthetic import generate_items
    from vlmrl.engine.rollout.generation import render_prompt

    processor = AutoProcessor.from_pretrained(str(processor_dir))
    item = next(iter(generate_items(1, seed=7, size=512)))
    text = render_prompt(processor, build_prompt_text(item.question))
    prompt = processor(text=[text], images=[[item.image]], return_tensors="pt")
    g = torch.Generator().manual_seed(0)
    completion = torch.randint(10, 200, (ROWS, COMPLETION), generator=g)
    ids = torch.cat([prompt["input_ids"].repeat(ROWS, 1), completion], 1)
    mm = torch.cat([prompt["mm_token_type_ids"].repeat(ROWS, 1), torch.zeros_like(completion)], 1)
    return {k: v.cuda() for k, v in {
        "input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": mm,
        "pixel_values": prompt["pixel_values"].repeat(ROWS, 1), "image_grid_thw": prompt["image_grid_thw"].repeat(ROWS, 1),
    }.items()} | {"logits_to_keep": COMPLETION, "num_images": [1] * ROWS}


def loss_pass(trainer, model, batch: dict, *, autocast: bool = True) -> torch.Tensor:
    """Forward and backward of one micro-batch under bf16 autocast (the mean log-prob stands in for the loss); the
    grads accumulate over the round, as over an optimizer step's micro-batches."""
    b = dict(batch)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, b.pop("input_ids"), b.pop("attention_mask"), b.pop("logits_to_keep"), compute_entropy=True, **b)
        loss = logps.float().mean()
    loss.backward()
    return logps.detach()


def table(r: dict) -> str:
    rounds = {v: ", ".join(f"{s:.2f}" for s in r["seconds_per_round"][v]) for v in VARIANTS}
    return "\n".join([
        (f"Device: {r['device']}; Qwen3-VL-8B shapes, random bf16 weights, LoRA r=16 (float32), TRL's loss pass "
         f"(fused log-prob head, gradient checkpointing, bf16 autocast): {r['micro_batches']} micro-batches x "
         f"{r['rows']} rows x {r['tokens_per_row']} tokens ({r['completion']} completion) per round, "
         f"{r['rounds']} rounds after one warm-up, the two variants alternating which goes first."),
        "",
        "| loss pass, one optimizer step | seconds (mean) | x floor | per round | peak GiB |",
        "|---|---|---|---|---|",
        *(f"| {name} | {r['mean_s'][v]:.2f} | {r['floor_ratio'][v]:.2f}x | {rounds[v]} | {r['peak_gib'][v]:.2f} |"
          for v, name in (("own", "the modules' own forwards"), ("liger", "Liger's kernels (vlmrl.engine.loss.kernels)"))),
        f"| floor | {r['floor_s']:.2f} | | | |",
        "",
        (f"Floor: 6 x language parameters x {r['tokens_per_round']} tokens at {r['ceilings']['matmul_tflops']:.0f} "
         f"TFLOP/s (bf16 matmul measured in this run). Installed: {r['installed']}. Largest log-prob difference "
         f"{r['max_log_prob_difference']:.1e}; largest relative difference of a LoRA gradient "
         f"{r['max_relative_lora_grad_difference']:.1e} ({r['lora_grads_compared']} compared)."),
        "",
    ])


if __name__ == "__main__":
    sys.exit(main())
