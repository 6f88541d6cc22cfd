"""What every bench path trains: the settings, the random-weight model with a named model's real shapes, the data.

The shapes ship in `vlmrl/preflight/shapes/*.json` (no download); the processor is a tiny Qwen3-VL folder whose tokenizer
serves the shaped model; the data is vlmrl's synthetic chart items. `save_shaped_model` writes the same model as
a loadable folder for the multi-GPU record check; `seed_overrides` is the seed recipe's config for a bench's
settings (what the preflight predicts for that run). Left out: measuring anything (`run`), the floors (`floors`).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlmrl.common import distributed
from vlmrl.preflight.memory import load_shapes

GIB = 2**30


# unsloth: in its own process (`bench.unsloth_path`). Engine variants: benchmarks/variants/ (`run.VARIANTS`).
PATHS = ("plain", "vlmrl", "unsloth")
# The bench's LoRA: language attention + MLP projections (the seed recipe's targets), vision tower frozen.
LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@dataclass
class BenchSettings:
    shapes: str = "qwen3_vl_8b"
    paths: list[str] = field(default_factory=lambda: ["plain", "vlmrl"])
    prompts: int = 8
    generations: int = 4
    completion: int = 1024
    steps: int = 2
    # Plain TRL compiles nothing, so its first step is already steady; in 4-bit one 1024-token step of it takes
    # minutes, and a record run may give it fewer steps than the compiled path (None = `steps`).
    steps_plain: int | None = None
    # Steps reported apart from the steady figures: the first compiles; the second still carries one-off work
    # (benchmarks/NOTES.md, "Over many steps"). A path that ran no more steps than this has only its first set apart.
    warmup_steps: int = 1
    lora_r: int = 16
    algorithm: str = "gspo"
    load_in_4bit: bool = False
    dtype: str = "bfloat16"  # or float16: the base (4-bit: its compute dtype) and the trainer's mixed precision
    # per_device_train_batch_size (None = `prompts`); the accumulation keeps prompts x generations completions per
    # optimizer step. steps_per_generation None = TRL's default (the accumulation: one rollout per optimizer step).
    micro_batch: int | None = None
    steps_per_generation: int | None = None
    memory_cap_gib: float | None = None
    image_size: int = 512
    prompt_bucket: int = 64
    # torch.compile's cache folder (`vlmrl.engine.rollout.compile_cache`); None = vlmrl's default. Two processes given the same
    # empty folder measure the first step cold, then warm.
    compile_cache: str | None = None
    # One more optimizer step after the measured ones, profiled for its NCCL kernel time (`vlmrl.bench.comm`) and
    # left out of the step times: the communication share on several GPUs.
    comm_profile: bool = False
    # A third reward, a hash of each completion's text in [0, 1) (`vlmrl.bench.run.varied_reward`): a random-weight
    # model earns nothing from the seed's two rewards, so its advantages and gradients are zero; with this one every
    # group's rewards differ and the optimizer step moves the adapter (e.g. to see fp16's loss scaler at work).
    varied_reward: bool = False
    # Ragged completions (`vlmrl.bench.ragged`): each completion's length drawn from a log-normal with this median
    # and a tenth at the cap (`completion`); None = every completion forced to the cap.
    ragged_median: int | None = None


def batching(settings: dict) -> tuple[int, int]:
    """(completions per micro-step, micro-steps per optimizer step) for a bench's settings (as a dict): `micro_batch`,
    else all `prompts` at once, and as many micro-steps as keep prompts x generations completions per step."""
    micro = settings.get("micro_batch") or settings["prompts"]
    return micro, settings["prompts"] * settings["generations"] // micro


def seed_overrides(settings: dict) -> list[str]:
    """The seed recipe's config overrides for a bench with these settings (`BenchSettings` as a dict, or any dict
    with its keys), the preflight's input for that run: the base (bf16 with AdamW, 4-bit with 8-bit Adam), the
    completion length and the batching. The rest (LoRA rank, generations, dtype) stays the seed's, as the bench
    runs it by default. A key left out takes `BenchSettings`' default."""
    s = {**BenchSettings().__dict__, **settings}
    micro, accumulation = batching(s)
    overrides = [f"model.load_in_4bit={str(bool(s['load_in_4bit'])).lower()}",
                 f"train.max_completion_length={s['completion']}",
                 f"train.per_device_train_batch_size={micro}",
                 f"train.gradient_accumulation_steps={accumulation}"]
    if s["steps_per_generation"]:
        overrides.append(f"train.steps_per_generation={s['steps_per_generation']}")
    if not s["load_in_4bit"]:
        overrides.append("train.optim=adamw_torch")
    return overrides


def build_processor(work: Path, image_size: int) -> Path:
    """A tiny Qwen3-VL folder whose tokenizer/processor/chat template serve the shaped model."""
    from vlmrl.models.tiny import build_tiny_model

    folder = work / "processor"
    if not (folder / "config.json").exists():
        build_tiny_model("qwen3_vl", folder, image_size=image_size)
    return folder


def build_shaped_model(shapes: dict, processor_dir: Path, *, load_in_4bit: bool, work: Path,
                       dtype: torch.dtype = torch.bfloat16) -> Any:
    """Random weights with the real shapes; token ids from the small tokenizer (all inside the real vocab)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    tiny = AutoConfig.from_pretrained(str(processor_dir))
    config_dict = {k: v for k, v in shapes.items() if not k.startswith("_")}
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        config_dict[key] = getattr(tiny, key)
    config_dict["text_config"] = {**config_dict["text_config"], "pad_token_id": tiny.text_config.pad_token_id}
    config = AutoConfig.for_model(**config_dict)
    if load_in_4bit:
        # bitsandbytes quantizes while loading: the random weights are saved once (every path reuses them) and
        # reloaded in 4-bit.
        return _load_4bit(save_weights_once(shapes, processor_dir, work), processor_dir, dtype)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    model.generation_config = _generation_config(processor_dir)
    return model


def save_weights_once(shapes: dict, processor_dir: Path, work: Path) -> Path:
    """The random bf16 weights as a loadable folder with the small processor beside them, written once per bench
    (`work/bf16-weights`): what 4-bit paths reload through bitsandbytes and the unsloth process loads by name."""
    import shutil

    saved = work / "bf16-weights"
    if not (saved / "config.json").exists():
        model = build_shaped_model(shapes, processor_dir, load_in_4bit=False, work=work)
        model.save_pretrained(str(saved))
        del model
        free_memory()
    for f in processor_dir.iterdir():
        if f.is_file() and not (saved / f.name).exists():  # tokenizer, processor, chat template
            shutil.copy2(f, saved / f.name)
    return saved


def _load_4bit(saved: Path, processor_dir: Path, dtype: torch.dtype = torch.bfloat16) -> Any:
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.loading import nf4_config

    model = AutoModelForImageTextToText.from_pretrained(str(saved), quantization_config=nf4_config(dtype),
                                                        dtype=dtype,
                                                        device_map={"": torch.cuda.current_device()})
    model.generation_config = _generation_config(processor_dir)
    return model


def save_shaped_model(out_dir: Path, shapes: str | dict = "qwen3_vl_8b", image_size: int = 512) -> Path:
    """A loadable model folder (random weights with the real shapes, the small processor): what `vlmrl eval`
    reads as `model.name=<folder>` in the multi-GPU record check (benchmarks/gpu_multi.sh)."""
    import shutil

    processor_dir = build_processor(out_dir.parent / f".{out_dir.name}-processor", image_size)
    shapes = load_shapes(shapes) if isinstance(shapes, str) else shapes
    model = build_shaped_model(shapes, processor_dir, load_in_4bit=False, work=out_dir.parent)
    model.save_pretrained(str(out_dir))
    for f in processor_dir.iterdir():
        if f.is_file() and not (out_dir / f.name).exists():  # tokenizer, processor, chat template
            shutil.copy2(f, out_dir / f.name)
    del model
    free_memory()
    return out_dir


def _generation_config(processor_dir: Path) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(str(processor_dir))


def bench_dataset(settings: BenchSettings) -> Any:
    import datasets

    from vlmrl.contract import build_prompt_text
    from vlmrl.data.synthetic import generate_items

    n = settings.prompts * distributed.world_size() * (max(settings.steps, settings.steps_plain or 0) + 1)
    items = list(generate_items(n, seed=7, size=settings.image_size))
    return datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": build_prompt_text(i.question)}] for i in items],
        "image": [i.image for i in items],
        "answer": [i.answer for i in items],
    })



def free_memory() -> None:
    """Collect garbage and hand cached CUDA blocks back, so one path's model does not count in the next's peak."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
