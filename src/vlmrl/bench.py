"""`vlmrl bench`: plain TRL `GRPOTrainer` and vlmrl's path, side by side, in one process, on one GPU.

Both paths train the same random-weight model with the real shapes of a named model (shipped in
`vlmrl/shapes/*.json`, no download), the same LoRA (r=16 on language attention + MLP), the same GRPOConfig
(the seed recipe: 8 prompts x 4 generations per step, GSPO) and completions forced to the full length
(`min_new_tokens`), so only the generation path differs:

  plain           `GRPOTrainer` exactly as a user writes it;
  vlmrl           the same trainer after `vlmrl.fastgen.enable_fast_generation` (static cache + compiled decode),
                  as `vlmrl train` runs it by default;
  vlmrl-merged    vlmrl with the adapter merged into the weights for rollouts (`train.rollout_merge=true`,
                  opt-in; optional).

Measured per optimizer step: wall time, generation time (decode ms per token step, tokens/s), training
tokens/s, peak GPU memory; and the two floors from ceilings measured on the same device in the same run:
decode is bandwidth-bound (weights + KV cache read once per token step), training FLOP-bound (6 x language
parameters x tokens: forward, checkpoint recompute, input-gradient backward; frozen weights get no weight
gradient). Results go to `bench.json` and a markdown table `bench.md`.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from vlmrl import distributed
from vlmrl.compile_cache import use_compile_cache

log = logging.getLogger(__name__)
GIB = 2**30


PATHS = ("plain", "vlmrl", "vlmrl-merged")
# The bench's LoRA: language attention + MLP projections (the seed recipe's targets), vision tower frozen.
LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
# Each fast path's ratios to plain are keyed with its prefix.
RATIO_PREFIXES = {"vlmrl": "", "vlmrl-merged": "merged_"}


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
    lora_r: int = 16
    algorithm: str = "gspo"
    load_in_4bit: bool = False
    memory_cap_gib: float | None = None
    image_size: int = 512
    prompt_bucket: int = 64
    # torch.compile's cache folder (`vlmrl.compile_cache`); None = vlmrl's default. Two processes given the same
    # empty folder measure the first step cold, then warm.
    compile_cache: str | None = None


def load_shapes(name: str) -> dict:
    text = resources.files("vlmrl.shapes").joinpath(f"{name}.json").read_text()
    return json.loads(text)


# ---- floors -------------------------------------------------------------------------------------------------

def decode_floor_ms(weight_bytes: float, kv_bytes_per_token: float, batch: int, prompt: int, completion: int,
                    bandwidth: float) -> float:
    """Mean time per decode step if every step only read the weights once plus the KV cache so far."""
    mean_context = prompt + completion / 2
    return 1e3 * (weight_bytes + kv_bytes_per_token * batch * mean_context) / bandwidth


def train_floor_s(language_params: float, tokens: float, flops: float) -> float:
    return 6 * language_params * tokens / flops


def kv_bytes_per_token(text_config: dict, dtype_bytes: int = 2) -> int:
    heads = text_config["num_key_value_heads"]
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // text_config["num_attention_heads"]
    return 2 * text_config["num_hidden_layers"] * heads * head_dim * dtype_bytes


def language_param_count(text_config: dict) -> int:
    """Parameters the decoder reads per token: attention, MLP, norms, embedding row and LM head."""
    h, i, layers = text_config["hidden_size"], text_config["intermediate_size"], text_config["num_hidden_layers"]
    heads, kv = text_config["num_attention_heads"], text_config["num_key_value_heads"]
    head_dim = text_config.get("head_dim") or h // heads
    attention = h * head_dim * (heads + 2 * kv) + heads * head_dim * h
    mlp = 3 * h * i
    lm_head = h * text_config["vocab_size"]
    return layers * (attention + mlp) + lm_head


def measure_ceilings(device: str = "cuda") -> dict:
    """bf16 matmul TFLOP/s and device copy bandwidth, measured here and now."""
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    flops = 2 * n**3 * reps / (time.perf_counter() - start)
    src = torch.empty(2 * GIB, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    bandwidth = 2 * src.numel() * 10 / (time.perf_counter() - start)  # read + write
    del a, b, src, dst
    torch.cuda.empty_cache()
    return {"matmul_tflops": flops / 1e12, "copy_bandwidth_tbs": bandwidth / 1e12}


# ---- model and data -------------------------------------------------------------------------------------------

def build_processor(work: Path, image_size: int) -> Path:
    """A tiny Qwen3-VL folder whose tokenizer/processor/chat template serve the shaped model."""
    from vlmrl.models.tiny import build_tiny_model

    folder = work / "processor"
    if not (folder / "config.json").exists():
        build_tiny_model("qwen3_vl", folder, image_size=image_size)
    return folder


def build_shaped_model(shapes: dict, processor_dir: Path, *, load_in_4bit: bool, work: Path) -> Any:
    """Random weights with the real shapes; token ids from the small tokenizer (all inside the real vocab)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    tiny = AutoConfig.from_pretrained(str(processor_dir))
    config_dict = {k: v for k, v in shapes.items() if not k.startswith("_")}
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        config_dict[key] = getattr(tiny, key)
    config_dict["text_config"] = {**config_dict["text_config"], "pad_token_id": tiny.text_config.pad_token_id}
    config = AutoConfig.for_model(**config_dict)
    saved = work / "bf16-weights"
    if load_in_4bit and (saved / "config.json").exists():  # an earlier path saved these random weights
        return _load_4bit(saved, processor_dir)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.generation_config = _generation_config(processor_dir)
    if not load_in_4bit:
        return model
    # bitsandbytes quantizes while loading: save the random weights once (every path reuses them), reload in 4-bit.
    model.save_pretrained(str(saved))
    del model
    _free()
    return _load_4bit(saved, processor_dir)


def _load_4bit(saved: Path, processor_dir: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.loading import nf4_config

    model = AutoModelForImageTextToText.from_pretrained(str(saved), quantization_config=nf4_config(torch.bfloat16),
                                                        dtype=torch.bfloat16,
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
    _free()
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


# ---- one path -------------------------------------------------------------------------------------------------

class _StepClock:
    """Wall time per optimizer step and generation time inside it (TRL generates once per step here), and the
    peak GPU memory of each phase: rollouts (inside `generate`) and everything else (loss pass, optimizer)."""

    def __init__(self):
        self.steps: list[dict] = []
        self._start = 0.0
        self._gen = 0.0
        self.generation_peaks: list[int] = []  # bytes, per generate call: is the first (compiling) call special?
        self.other_peak = 0
        self.reserved_peak = 0  # the allocator's own peak, kept across the per-phase resets

    def callback(self) -> Any:
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                torch.cuda.synchronize()
                clock._start, clock._gen = time.perf_counter(), 0.0

            def on_step_end(self, args, state, control, **kwargs):
                torch.cuda.synchronize()
                clock.steps.append({"seconds": time.perf_counter() - clock._start, "generate_seconds": clock._gen})

        return Clock()

    def wrap_generation(self, trainer: Any) -> None:
        inner = trainer._generate_single_turn

        def timed(*args, **kwargs):
            torch.cuda.synchronize()
            self.other_peak = max(self.other_peak, self.take_peak())
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            torch.cuda.synchronize()
            self._gen += time.perf_counter() - start
            self.generation_peaks.append(self.take_peak())
            return out

        trainer._generate_single_turn = timed

    def take_peak(self) -> int:
        """Allocated-memory peak since the last call (bytes), then start a new phase."""
        peak = torch.cuda.max_memory_allocated()
        self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
        return peak


def run_path(path: str, settings: BenchSettings, shapes: dict, processor_dir: Path, dataset: Any, work: Path) -> dict:
    from peft import LoraConfig
    from transformers import AutoProcessor
    from trl import GRPOConfig, GRPOTrainer

    from vlmrl.fastgen import enable_fast_generation
    from vlmrl.models.loading import multimodal_token_ids
    from vlmrl.rewards import correctness_reward, format_reward

    _free()
    model = build_shaped_model(shapes, processor_dir, load_in_4bit=settings.load_in_4bit, work=work)
    torch.cuda.reset_peak_memory_stats()  # the peak of training, not of building the random model
    processor = AutoProcessor.from_pretrained(str(processor_dir))
    # TRL re-processes prompts for the loss with the processor's own padding side but pads prompt ids on the
    # left; with right padding and prompts of different lengths the image-token mask is shifted and Qwen's
    # rope index crashes (TRL 1.16). vlmrl's loader always sets left; the plain path needs it to run at all.
    processor.tokenizer.padding_side = "left"
    args = GRPOConfig(
        output_dir=str(work / f"out-{path}"),
        per_device_train_batch_size=settings.prompts,
        gradient_accumulation_steps=settings.generations,
        num_generations=settings.generations,
        max_completion_length=settings.completion,
        # Full-length completions; and no image/video delimiter tokens, which a random-weight model samples
        # (TRL suppresses only the image token; a stray <|vision_start|> crashes the next forward pass).
        generation_kwargs={"min_new_tokens": settings.completion,
                           "suppress_tokens": multimodal_token_ids(model.config)},
        importance_sampling_level="sequence" if settings.algorithm == "gspo" else "token",
        loss_type="dr_grpo",
        learning_rate=5e-6,
        max_grad_norm=0.1,
        max_steps=path_steps(settings, path),
        gradient_checkpointing=True,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        optim="adamw_8bit" if settings.load_in_4bit else "adamw_torch",
        reward_weights=[0.3, 1.0],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    peft_config = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_r, task_type="CAUSAL_LM",
                             target_modules=LORA_TARGETS)
    clock = _StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=[format_reward, correctness_reward], args=args,
                          train_dataset=dataset, processing_class=processor, peft_config=peft_config,
                          callbacks=[clock.callback()])
    fast = (enable_fast_generation(trainer, bucket=settings.prompt_bucket, merge=path == "vlmrl-merged")
            if path.startswith("vlmrl") else None)
    clock.wrap_generation(trainer)
    started = time.perf_counter()
    error = None
    try:
        trainer.train()
    except Exception as exc:  # one path failing must not hide the other's numbers
        error = f"{type(exc).__name__}: {exc}"[:2000]
        log.exception("bench path %s failed", path)
    other_peak = max(clock.other_peak, clock.take_peak())
    generation_peak = max(clock.generation_peaks, default=0)
    peak = max(generation_peak, other_peak) / GIB
    result = {
        "path": path,
        "error": error,
        "fast_generation": fast.as_dict() if fast else None,
        "total_seconds": time.perf_counter() - started,
        "steps": clock.steps,
        "peak_memory_gib": peak,
        "generation_peak_gib": generation_peak / GIB,
        "generation_peaks_gib": [round(p / GIB, 3) for p in clock.generation_peaks],
        "training_peak_gib": other_peak / GIB,
        "peak_reserved_gib": clock.reserved_peak / GIB,
        "world_size": distributed.world_size(),
        "peak_memory_gib_per_rank": _gather(peak),
        "log": [row for row in trainer.state.log_history if "loss" in row],
    }
    del trainer, model
    _free()
    return result


def path_steps(settings: BenchSettings, path: str) -> int:
    """Optimizer steps a path runs: `steps`, or `steps_plain` for plain TRL when given."""
    return settings.steps_plain if path == "plain" and settings.steps_plain else settings.steps


def _gather(value: float) -> list[float]:
    """One value per rank (a one-element list in a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the whole benchmark -------------------------------------------------------------------------------------

def run_bench(settings: BenchSettings, out_dir: Path, work: Path) -> dict:
    """Run each path; under `accelerate launch` every rank runs it on its own GPU and rank 0 writes."""
    compile_cache, work = prepare_device(settings, work)
    shapes = load_shapes(settings.shapes)
    ceilings = measure_ceilings()
    processor_dir = build_processor(work, settings.image_size)
    dataset = bench_dataset(settings)
    results = []
    for path in settings.paths:
        results.append(run_path(path, settings, shapes, processor_dir, dataset, work))
        if distributed.is_main_process():  # a run stopped by a time limit still leaves the paths it finished
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "bench.partial.json").write_text(json.dumps(results, indent=2, default=str))
    prompt_tokens = prompt_tokens_of(processor_dir, dataset)
    summary = summarize(settings, shapes, ceilings, results, prompt_tokens)
    summary["compile_cache"] = compile_cache.as_dict()  # was the first step's compile served from disk?
    if distributed.is_main_process():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench.json").write_text(json.dumps(summary, indent=2, default=str))
        (out_dir / "bench.md").write_text(markdown_table(summary))
    return summary


def prepare_device(settings: BenchSettings, work: Path) -> tuple[Any, Path]:
    """This rank's GPU, its memory cap and the compile cache, before anything is built; and its work folder."""
    import os

    if not torch.cuda.is_available():
        raise RuntimeError("vlmrl bench needs a CUDA GPU; the CPU tests cover its bookkeeping only.")
    compile_cache = use_compile_cache(Path(settings.compile_cache) if settings.compile_cache else None)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if distributed.world_size() > 1:
        work = work / f"rank{distributed.rank()}"  # no two ranks write the same processor or weight files
    if settings.memory_cap_gib:
        total = torch.cuda.get_device_properties(local_rank).total_memory / GIB
        torch.cuda.set_per_process_memory_fraction(min(1.0, settings.memory_cap_gib / total), local_rank)
    return compile_cache, work


def prompt_tokens_of(processor_dir: Path, dataset: Any) -> int:
    from transformers import AutoProcessor

    from vlmrl.generation import count_prompt_tokens

    processor = AutoProcessor.from_pretrained(str(processor_dir))
    row = dataset[0]
    return count_prompt_tokens(processor, row["prompt"][0]["content"], row["image"])


def summarize(settings: BenchSettings, shapes: dict, ceilings: dict, results: list[dict], prompt_tokens: int) -> dict:
    """Per-path steady-state figures (first step excluded when there are more) and the floors."""
    text = shapes["text_config"]
    batch = settings.prompts * settings.generations
    language = language_param_count(text)
    weight_bytes = language * (0.5 if settings.load_in_4bit else 2)
    bandwidth = ceilings["copy_bandwidth_tbs"] * 1e12
    tokens = batch * (prompt_tokens + settings.completion)
    floors = {
        "decode_ms_per_step": decode_floor_ms(weight_bytes, kv_bytes_per_token(text), batch, prompt_tokens,
                                              settings.completion, bandwidth),
        "train_seconds_per_step": train_floor_s(language, tokens, ceilings["matmul_tflops"] * 1e12),
    }
    floors["step_seconds"] = floors["decode_ms_per_step"] * settings.completion / 1e3 + floors["train_seconds_per_step"]
    paths = {}
    for r in results:
        steps = r["steps"][1:] if len(r["steps"]) > 1 else r["steps"]
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
            "decode_ms_per_step": 1e3 * gen / settings.completion,
            "decode_tokens_per_second": batch * settings.completion / gen if gen else None,
            "train_tokens_per_second": tokens / (step - gen) if step > gen else None,
            "peak_memory_gib": r["peak_memory_gib"],
            "generation_peak_gib": r.get("generation_peak_gib"),
            "training_peak_gib": r.get("training_peak_gib"),
            "peak_memory_gib_per_rank": r.get("peak_memory_gib_per_rank", [r["peak_memory_gib"]]),
            "peak_reserved_gib": r["peak_reserved_gib"],
            "steps_measured": len(steps),
            # plain compiles nothing; when it ran a single step that step is its steady one, compilation-free
            "first_step_excluded": len(r["steps"]) > 1,
            "fast_generation": r["fast_generation"],
        }
    ratios = {}
    for name, prefix in RATIO_PREFIXES.items():
        if "step_seconds" in paths.get("plain", {}) and "step_seconds" in paths.get(name, {}):
            p, v = paths["plain"], paths[name]
            ratios.update({
                f"{prefix}step_speedup": p["step_seconds"] / v["step_seconds"],
                f"{prefix}decode_speedup": p["decode_ms_per_step"] / v["decode_ms_per_step"],
                f"{prefix}vlmrl_decode_vs_floor": v["decode_ms_per_step"] / floors["decode_ms_per_step"],
                f"{prefix}peak_memory_ratio": v["peak_memory_gib"] / p["peak_memory_gib"],
            })
    return {
        "settings": asdict(settings),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "versions": _versions(),
        "ceilings": ceilings,
        "prompt_tokens": prompt_tokens,
        "language_params": language,
        "floors": floors,
        "paths": paths,
        "ratios": ratios,
        "raw": results,
    }


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "trl", "peft", "bitsandbytes"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


# What each fast path ran, as the markdown table names it (fields of `FastGeneration`; absent in older records).
SETTING_LABELS = (("attention ", "attention"), ("autocast ", "autocast"), ("prompt pass: ", "prefill"),
                  ("adapter: ", "merge"), ("adapter weights: ", "adapters"), ("stop check: ", "stop_check"))


def markdown_table(summary: dict) -> str:
    s = summary["settings"]
    lines = [
        f"Device: {summary['device']}; shapes {s['shapes']}; {s['prompts']} prompts x {s['generations']} generations, "
        f"completion {s['completion']} tokens (forced), prompt {summary['prompt_tokens']} tokens, LoRA r={s['lora_r']}, "
        f"{s['algorithm'].upper()}, {'4-bit' if s['load_in_4bit'] else 'bf16'}"
        + (f", memory capped at {s['memory_cap_gib']} GiB" if s["memory_cap_gib"] else ""),
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
    lines += ["", (f"Ceilings measured in this run: {c['matmul_tflops']:.0f} TFLOP/s bf16 matmul, "
                   f"{c['copy_bandwidth_tbs']:.2f} TB/s device copy. Floors: decode = (weights + mean KV cache) / "
                   f"bandwidth; training = 6 x {summary['language_params'] / 1e9:.2f}B language parameters x tokens / "
                   "matmul rate.")]
    if cache := summary.get("compile_cache"):
        lines.append(f"Compile cache {cache['inductor_dir']}: {'cold (empty)' if cache['cold'] else 'warm'} at the "
                     f"start ({cache['files_at_start']} files); the first step column includes compilation.")
    r = summary["ratios"]
    for name, prefix in RATIO_PREFIXES.items():
        if f"{prefix}step_speedup" in r:
            lines.append(f"Ratios, {name} vs plain: step {r[prefix + 'step_speedup']:.2f}x faster, decode "
                         f"{r[prefix + 'decode_speedup']:.2f}x faster, decode {r[prefix + 'vlmrl_decode_vs_floor']:.2f}x "
                         f"the floor, peak memory {r[prefix + 'peak_memory_ratio']:.2f}x plain.")
    for name, p in summary["paths"].items():  # what each fast path ran, as recorded when it was set up
        fast = p.get("fast_generation") or {}
        if fast.get("enabled"):
            ran = [f"{label}{fast[key]}" for label, key in SETTING_LABELS if fast.get(key) is not None]
            lines.append(f"{name}: {', '.join(ran)}.")
    return "\n".join(lines) + "\n"


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
