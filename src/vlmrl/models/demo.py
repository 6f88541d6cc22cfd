"""The demo policy: a small Qwen3-VL-architecture model the project trains itself, offline, on the CPU.

RL only helps a policy that sometimes earns reward. A random-weight model never writes `<SOLUTION>`, so every
GRPO group has identical rewards and nothing moves. This module builds one that can learn: a tiny Qwen3-VL
(4 layers, hidden 128) given a short supervised warm start (`vlmrl.models.warm_start`) on synthetic figures, *stopped
early* on purpose, so it follows the output structure only part of the time and answers a minority right.
The embedded `vlmrl run` then has room to show RL moving both numbers.

It is built once per recipe into a cache folder (`$VLMRL_CACHE`, default `~/.cache/vlmrl`) in about a
minute on 2 cores, and reused. `DEMO_GPU_RECIPE` (model name `demo-policy-gpu`, the `demo-gpu` preset) is the
same build at a size that can learn to read its figures (45.6M parameters, 256 px, two counting families), warm-started
on a CUDA GPU in bf16 autocast (2-3 minutes on an H200, at most 400 steps) while its reading is still noisy;
`DEMO_GPU_SMOKE_RECIPE` (`demo-policy-gpu-smoke`) is that recipe shrunk so its every line runs on a CPU. The warm-start data use a different seed from any run's data stream
(`SFT_DATA_SEED`), so the demo's held-out items are never seen in the warm start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from vlmrl.common.paths import cache_root

log = logging.getLogger(__name__)

DEMO_RECIPE = {
    "arch": "qwen3_vl",
    "hidden_size": 128,
    "num_layers": 4,
    "image_size": 128,
    "weight_seed": 0,
    "families": ["count_squares", "bar_value"],
    "sft_items": 512,
    # Half the warm-start answers are bare numbers without the structure, so the policy writes the structure
    # only about half the time when sampling; stopped early, so it answers only a minority right.
    "bare_answer_fraction": 0.5,
    "sft_steps": 150,
    "sft_batch_size": 16,
    "sft_learning_rate": 2e-3,
    # a check curve only (no stop): greedy answers on figures kept apart, recorded beside the policy
    "check_every": 50,
    "check_items": 32,
    "version": 1,
}
# Sized to read, not to be fast: 12 text layers at 512, a 6-block vision tower seeing 256 px (64 image tokens).
# The warm start teaches the structure and the answer prior within the first hundred steps; reading the count
# of squares or points takes longer, so the stop is a reading criterion, not a step count:
# every `check_every` steps the policy answers `check_items` unseen figures greedily, and the warm start stops
# once `stop_accuracy` of them are right (at most `sft_steps`). Stopped there, sampling at temperature 1 gives
# groups holding right and wrong readings of one image: the signal GSPO needs to sharpen the reading itself.
# The demo trains on the two families read from the picture itself (squares, scatter points); bar values, circle
# areas and plotted points need small text this policy does not learn to read (docs/learning.md).
# At a constant rate from the first step the reading check jumped between checks (down to 0 and back), so where
# the warm start stopped decided the RL result: the rate now warms up and decays on a cosine, the checks and the
# saved policy use a moving average of the weights, and a build that never reaches the criterion keeps its
# best check's weights and says so (`warm_start_note`). With AdamW's default second-moment decay (0.999) one seed
# of three still fell to 0 between two checks (a loss spike): its second moment now decays at 0.95, and the
# average spans about 30 steps.
DEMO_GPU_RECIPE = {
    "arch": "qwen3_vl",
    "hidden_size": 512,
    "num_layers": 12,
    "vision_depth": 6,
    "image_size": 256,
    "weight_seed": 0,
    "families": ["count_squares", "scatter_count"],
    "sft_items": 6144,
    "bare_answer_fraction": 0.1,
    "sft_steps": 800,
    "sft_batch_size": 64,
    "sft_learning_rate": 5e-4,
    "sft_warmup_steps": 30,
    "sft_schedule": "cosine",
    "sft_adam_beta2": 0.95,
    "ema_decay": 0.97,
    "stop_accuracy": 0.45,
    "check_every": 25,
    "check_items": 256,
    "device": "cuda",
    "bf16_autocast": True,
    "prefetch": True,  # the next batch is built while this one trains: the processor is the GPU build's bottleneck
    "version": 3,
}
# The GPU recipe at a size two CPU cores build in a minute: the same code path (bf16 autocast, prefetch, checks).
DEMO_GPU_SMOKE_RECIPE = {
    **DEMO_GPU_RECIPE, "hidden_size": 64, "num_layers": 2, "vision_depth": 2, "image_size": 64,
    "sft_items": 256, "sft_steps": 80, "sft_batch_size": 8, "sft_learning_rate": 3e-3, "check_every": 40,
    "check_items": 8, "device": "cpu",
}
RECIPES = {"demo-policy": DEMO_RECIPE, "demo-policy-gpu": DEMO_GPU_RECIPE, "demo-policy-gpu-smoke": DEMO_GPU_SMOKE_RECIPE}
SFT_DATA_SEED = 1_000_003


def recipe_for(name: str, seed: int = 0) -> dict:
    """The build recipe of demo policy `name` for a run seeded `seed`: the weights' initialisation and the
    warm start's batch order follow the run's seed, so every seed starts from its own policy build."""
    return {**RECIPES[name], "weight_seed": seed}


def demo_policy_dir(recipe: dict = DEMO_RECIPE) -> Path:
    """The cache folder of `recipe`'s build. A CPU build with the host's own kernels (VLMRL_CPU_KERNELS=native)
    gets a folder of its own: its weights differ from the pinned kernels' build (`vlmrl.common.cpu_numerics`)."""
    from vlmrl.common.cpu_numerics import native

    if recipe.get("device", "cpu") == "cpu" and native():
        recipe = {**recipe, "cpu_kernels": "native"}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]
    return cache_root() / f"demo-policy-{digest}"


def ensure_demo_policy(recipe: dict = DEMO_RECIPE, say=None) -> Path:
    """The demo policy's folder, building it first if this machine has not yet. When its warm start stopped
    short of its reading criterion, says so in one line, once per process (every run, not only the build's)."""
    folder = demo_policy_dir(recipe)
    if not (folder / "demo_policy.json").exists():
        _build_into(folder, recipe, say)
    if folder not in _NOTED and (note := warm_start_note(folder)) is not None:
        _NOTED.add(folder)
        (say or log.warning)(note)
    return folder


_NOTED: set[Path] = set()  # the policies whose short warm start this process has said (a run resolves it per stage)


def _build_into(folder: Path, recipe: dict, say) -> None:
    where = recipe.get("device", "cpu")
    (say or log.warning)(f"building the demo policy once into {folder} (supervised warm start on {where}, ~1 min)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".demo-policy-"))
    try:
        info = build_demo_policy(staging, recipe, say=say)
        (staging / "demo_policy.json").write_text(json.dumps(info, indent=2))
        if folder.exists():  # a concurrent build won; keep theirs
            shutil.rmtree(staging)
        else:
            os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def warm_start_note(folder: Path) -> str | None:
    """One line when the policy in `folder` stopped its warm start short of its reading criterion, else None."""
    try:
        info = json.loads((folder / "demo_policy.json").read_text())
    except (OSError, ValueError):
        return None
    if info.get("reached_criterion") is not False:  # reached it, or a recipe without one
        return None
    best = max((c["greedy_accuracy"] for c in info.get("reading_checks", [])), default=0.0)
    return (f"note: the demo policy's warm start stopped at step {info.get('sft_steps_run')} short of its reading "
            f"criterion ({info['recipe'].get('stop_accuracy')} greedy; best {best:.3f}, kept): RL starts from a "
            f"weaker reader than the docs' runs (its check curve: {folder / 'demo_policy.json'})")


def build_demo_policy(out_dir: Path, recipe: dict = DEMO_RECIPE, say=None) -> dict:
    """Build the tiny model, warm-start it, save it as an ordinary HF folder; returns what was done, with the
    warm start's check curve and whether it reached its criterion."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmrl.data.synthetic import generate_items
    from vlmrl.models.tiny import build_tiny_model
    from vlmrl.models.warm_start import Ema, SftExample, sft_train

    torch.manual_seed(recipe["weight_seed"])
    extra = {"vision_depth": recipe["vision_depth"]} if "vision_depth" in recipe else {}
    build_tiny_model(
        recipe["arch"], out_dir, seed=recipe["weight_seed"], hidden_size=recipe["hidden_size"],
        num_layers=recipe["num_layers"], image_size=recipe["image_size"], **extra,
    )
    device = recipe.get("device", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("this demo policy's recipe warm-starts on a CUDA GPU and this machine has none.")
    # float32 master weights (AdamW in bf16 loses small updates); bf16 autocast, where asked, for the speed
    model = AutoModelForImageTextToText.from_pretrained(str(out_dir), dtype=torch.float32).to(device)
    processor = AutoProcessor.from_pretrained(str(out_dir))
    processor.tokenizer.padding_side = "left"
    rng = random.Random(SFT_DATA_SEED)
    examples = [
        SftExample(
            prompt=_prompt(item.question),
            image=item.image,
            target=item.answer if rng.random() < recipe["bare_answer_fraction"] else _target(item.family, item.answer),
        )
        for item in generate_items(recipe["sft_items"], seed=SFT_DATA_SEED, size=recipe["image_size"],
                                   families=recipe["families"])
    ]
    started = time.perf_counter()
    from vlmrl.common.progress import counter

    tick = counter("demo policy: warm-start steps")
    stop_at, every, checks = recipe.get("stop_accuracy"), recipe.get("check_every"), []
    # figures of their own seed: apart from the warm start's and from every run's held-out set
    check_items = list(generate_items(recipe["check_items"], seed=SFT_DATA_SEED + 1, size=recipe["image_size"],
                                      families=recipe["families"])) if every else []
    ema = Ema(model, recipe["ema_decay"]) if recipe.get("ema_decay") else None
    best: dict = {"accuracy": -1.0, "weights": None}

    def on_step(step: int, _loss: float) -> bool:
        tick(step, recipe["sft_steps"])
        if not every or step % every:
            return False
        if ema is not None:
            with ema.swapped():
                checks.append({"step": step, **reading_check(model, processor, check_items)})
        else:
            checks.append({"step": step, **reading_check(model, processor, check_items)})
        accuracy = checks[-1]["greedy_accuracy"]
        if ema is not None and accuracy > best["accuracy"]:
            best.update(accuracy=accuracy, weights=ema.snapshot())
        by_family = ", ".join(f"{k} {v:.2f}" for k, v in checks[-1]["by_family"].items())
        if stop_at:
            (say or log.warning)(f"demo policy: step {step}, greedy accuracy on {len(check_items)} unseen figures "
                                 f"{accuracy:.3f} (stops at {stop_at}; {by_family})")
        return bool(stop_at) and accuracy >= stop_at

    losses = sft_train(model, processor, examples, steps=recipe["sft_steps"], batch_size=recipe["sft_batch_size"],
                       learning_rate=recipe["sft_learning_rate"], seed=recipe["weight_seed"], on_step=on_step,
                       bf16_autocast=recipe.get("bf16_autocast", False), prefetch=recipe.get("prefetch", False),
                       warmup_steps=recipe.get("sft_warmup_steps", 0), schedule=recipe.get("sft_schedule", "constant"),
                       ema=ema, adam_beta2=recipe.get("sft_adam_beta2", 0.999))
    reached = bool(checks) and bool(stop_at) and checks[-1]["greedy_accuracy"] >= stop_at
    kept_step = checks[-1]["step"] if checks else len(losses)
    if ema is not None:
        # the averaged weights that passed the criterion; short of it, the best check's
        if stop_at and not reached and best["weights"] is not None:
            ema.load(best["weights"])
            kept_step = max(checks, key=lambda c: c["greedy_accuracy"])["step"]
        else:
            ema.load(ema.snapshot())
    model.to("cpu").save_pretrained(str(out_dir))
    processor.save_pretrained(str(out_dir))
    return {"recipe": recipe, "sft_seconds": round(time.perf_counter() - started, 1), "sft_losses": losses,
            "sft_steps_run": len(losses), "reading_checks": checks,
            "reached_criterion": reached if stop_at else None, "kept_step": kept_step}


def reading_check(model, processor, items: list, batch: int = 128) -> dict:
    """The share of `items` the model answers right greedily (the warm start's stop criterion), overall and per
    family, and the share written in the contract's structure: a family at its answer prior is one the policy
    does not read yet, and RL cannot sharpen that reading.

    The model is left in train mode."""
    import torch

    from vlmrl.engine.rollout.generation import generate_batch
    from vlmrl.grading.rewards import score_completion

    model.eval()
    right: dict[str, list[bool]] = {}
    formatted = 0
    with torch.no_grad():
        for start in range(0, len(items), batch):
            chunk = items[start : start + batch]
            generations = generate_batch(model, processor, [_prompt(i.question) for i in chunk],
                                         [[i.image] for i in chunk], max_new_tokens=48)
            for g, item in zip(generations, chunk):
                scored = score_completion(g[0].text, item.answer, answer_type=item.answer_type,
                                          precision=item.precision)
                right.setdefault(item.family, []).append(bool(scored["correct"]))
                formatted += bool(scored["format_ok"])
    model.train()
    total = sum(len(v) for v in right.values())
    return {"greedy_accuracy": sum(sum(v) for v in right.values()) / total if total else 0.0,
            "format_rate": formatted / total if total else 0.0,
            "by_family": {name: sum(v) / len(v) for name, v in sorted(right.items())}}


def _prompt(question: str) -> str:
    from vlmrl.contract import build_prompt_text

    return build_prompt_text(question)


REASONING_BY_FAMILY = {
    "bar_value": "I read the height of the bar.",
    "count_squares": "I count the squares.",
    "circle_area": "I read the radius and use pi r^2.",
    "function_value": "I read the curve at that x.",
}


def _target(family: str, answer: str) -> str:
    from vlmrl.contract import render_answer

    return render_answer(REASONING_BY_FAMILY.get(family, "I look at the figure."), answer)
