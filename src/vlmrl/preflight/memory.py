"""Memory preflight: predict a run's peak GPU memory from the config and the model's shapes, before loading.

The prediction is arithmetic on the same quantities that fill the card:

    weights            all parameters x bytes per parameter (bf16 2, bnb nf4 ~0.56 with its scales; the vision
                       tower and LM head stay 16-bit under 4-bit loading)
    LoRA + optimizer   trainable parameters x 16 bytes (fp32 weight, gradient, two Adam moments; 8-bit Adam: 10)
    rollout KV cache   generation batch x (prompt + completion, rounded up to the bucket with fast generation)
                       x layers x 2 x kv heads x head dim x 2 bytes
    prefill            generation batch x prompt tokens x (6 x intermediate + 8 x hidden) x 2 bytes: the prompt
                       pass's MLP and projection temporaries (with the LoRA branches)
    decode excess      with fast generation, the decode phase's measured excess over weights + static cache:
                       about one prompt-sized KV cache (generation batch x prompt tokens x KV bytes per token),
                       fitted to the H200 peaks; not explained yet (the prompt pass's dynamic cache is freed layer
                       by layer as it is moved into the static one, so it is not that cache)
    adapter copies     with fast generation where stacking does not apply, in rollouts only: LoRA parameters x 2 bytes
                       (vlmrl.engine.rollout.adapter_cast), while the optimizer's moments (8 bytes a parameter with
                       AdamW) wait on the host (vlmrl.engine.rollout.offload)
    stacked projections with fast generation over an unquantized base, instead of the copies: the first factors' rows kept beside the
                       base weights (about half the LoRA parameters x 2 bytes, always) and the block-diagonal
                       second factors in rollouts (about the LoRA parameters x 2 bytes; vlmrl.engine.rollout.stacked);
                       over a 4-bit base whose token steps are recorded only the first factors are stacked, a few
                       hundredths of a GiB for an 8B model, not counted
    training           one micro-batch: checkpointed layer inputs (tokens x hidden x 2 bytes x layers) plus one
                       one layer's backward (3x its activations: the recomputed activations, their gradients and
                       the backward's temporaries; the factor the H200 peaks give) and the chunked log-prob pass

Rollouts and the loss pass do not overlap (transformers builds a new static cache per `generate` call and frees
it afterwards; the H200 runs measure each phase's peak apart), so the peak is the larger of the two phases.
In the rollout phase the prompt pass runs on a dynamic cache in both paths (vlmrl moves it into the static
cache afterwards, `vlmrl.engine.rollout.fast`), so its temporaries meet a prompt-sized cache; the full cache is reached
only while decoding. Host RAM: the model is loaded through host memory once, so about the weights' size plus
4 GiB.

Several GPUs (`gpus`, `strategy`): DDP and ZeRO-2 keep a whole model per GPU (ZeRO-2 shards the LoRA
gradients and Adam's moments 1/N); FSDP2 and ZeRO-3 shard the weights and the LoRA state 1/N and gather, at a time,
the block in use and the next one plus the LM head (accelerate's tail unit stays gathered); bitsandbytes' 4-bit
storage is left out of FSDP2's sharding by accelerate, so it stays whole. In rollouts FSDP2 gathers block by block
(TRL's summon_full_params does nothing for FSDP2) while ZeRO-3 gathers the whole model (TRL's
ds3_gather_for_generation). Sharded runs make no stacked projections or adapter copies. The KV cache, the prompt
pass and the loss pass's activations are per GPU and are not divided. Not yet checked against GPU measurements:
`benchmarks/gpu_scaling.py` records each configuration's prediction beside its measured peak.

`train.auto_batch` (`choose_batch`) uses the same prediction the other way round: the largest per-device batch
(a multiple of num_generations) whose predicted peak fits the card, so a user with a bigger card need not search.

Checked against the H200 benchmarks (`benchmarks/NOTES.md`: bf16 plain and vlmrl, 4-bit, 256-token
completions, and generation batches of 32 to 256 completions in bf16 and 4-bit); the tests pin those measured
peaks and cover the arithmetic.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from vlmrl.config.schema import PRESETS, Config

GIB = 2**30
GPU_MARGIN = 0.92  # the share of a card a prediction may fill: the allocator's fragmentation and CUDA's context
SHAPES_BY_NAME = {"qwen3-vl-8b": "qwen3_vl_8b", "qwen3-vl-32b": "qwen3_vl_32b"}


@dataclass(frozen=True)
class MemoryEstimate:
    weights_gib: float
    lora_and_optimizer_gib: float
    kv_cache_gib: float
    prefill_gib: float
    training_gib: float
    peak_gib: float
    host_ram_gib: float

    def as_dict(self) -> dict:
        return {k: round(v, 2) for k, v in self.__dict__.items()}


def shapes_for(model_name: str) -> dict | None:
    """The model's config: a local config.json, or a shipped shapes file for a known hub id."""
    local = Path(model_name) / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    lowered = model_name.lower()
    for key, shapes in SHAPES_BY_NAME.items():
        if key in lowered:
            return load_shapes(shapes)
    return None


def count_params(shapes: dict) -> tuple[int, int, int]:
    """(language decoder params incl. embeddings and head, vision params, LoRA params per rank unit)."""
    t = shapes["text_config"]
    h, i, layers, vocab = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"], t["vocab_size"]
    heads, kv = t["num_attention_heads"], t["num_key_value_heads"]
    d = t.get("head_dim") or h // heads
    tied = shapes.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    # the decoder as read per token (layers + LM head), plus the embedding table when it is not the head
    language = language_param_count(t) + (0 if tied else vocab * h)
    v = shapes.get("vision_config", {})
    vh, vi, depth = v.get("hidden_size", 0), v.get("intermediate_size", 0), v.get("depth", 0)
    vision = depth * (4 * vh * vh + 2 * vh * vi) + vh * v.get("out_hidden_size", h) * 4
    # LoRA A (in x r) + B (r x out) for q, k, v, o, gate, up, down, per unit of rank
    lora_unit = layers * ((h + heads * d) + 2 * (h + kv * d) + (heads * d + h) + 2 * (h + i) + (i + h))
    return language, vision, lora_unit


def estimate_memory(config: Config, shapes: dict, *, prompt_tokens: int, fast_generation: bool, gpus: int = 1,
                    strategy: str = "ddp", adapters: str | None = None) -> MemoryEstimate:
    """The peak of one GPU; `gpus` and `strategy` (ddp | fsdp | zero2 | zero3, as `--strategy`): what is sharded
    over the N processes of the run (the module docstring, "Several GPUs"). `adapters`: how fast rollouts read
    the LoRA weights, `stacked` | `copies` | `as stored`; None = what vlmrl runs (the others are its fallbacks and
    the engine variants of benchmarks/engine_variants.py, whose measured peaks calibrate this)."""
    t = shapes["text_config"]
    language, vision, lora_unit = count_params(shapes)
    head = t["vocab_size"] * t["hidden_size"]
    # nf4 + double-quantized scales for the decoder's linear layers; the vision tower, embeddings and head stay 16-bit
    quantized = (language - head) * 0.5625 if config.model.load_in_4bit else 0
    weights = quantized + ((head + vision) * 2 if config.model.load_in_4bit else (language + vision) * 2)
    lora = lora_unit * config.lora.r
    optimizer_bytes = 10 if "8bit" in config.train.optim else 16
    resident, rollout_weights, lora_state = _per_gpu(t, weights, quantized, lora * optimizer_bytes, optimizer_bytes,
                                                     gpus, strategy)
    tr = config.train
    generation_batch = tr.per_device_train_batch_size * (tr.steps_per_generation or tr.gradient_accumulation_steps)
    kv_per_token = kv_bytes_per_token(t)
    bucket = config.train.rollout.prompt_bucket if fast_generation else 1  # fast generation rounds the cache length up
    cache_positions = -(-(prompt_tokens + tr.max_completion_length - 1) // bucket) * bucket
    kv = generation_batch * cache_positions * kv_per_token
    prefill = generation_batch * prompt_tokens * (6 * t["intermediate_size"] + 8 * t["hidden_size"]) * 2
    tokens = tr.per_device_train_batch_size * (prompt_tokens + tr.max_completion_length)
    checkpoints = tokens * t["hidden_size"] * 2 * t["num_hidden_layers"]
    one_layer = tokens * (6 * t["hidden_size"] + 3 * t["intermediate_size"]) * 2
    logprob_pass = tr.per_device_train_batch_size * tr.max_completion_length * t["vocab_size"] * 4 / 8  # chunked
    # the backward of one checkpointed layer: its recomputed activations, their gradients and the backward's own
    # temporaries; 3x one layer's activations is the factor the H200 peaks give (benchmarks/NOTES.md)
    training = (checkpoints if tr.gradient_checkpointing else checkpoints * 8) + 3 * one_layer + logprob_pass
    fixed = resident + lora_state
    # bf16 adapter copies for rollouts (vlmrl.engine.rollout.adapter_cast): only over an unquantized base (QLoRA's adapters are
    # bf16 already), made for each rollout while the optimizer's moments wait on the host (vlmrl.engine.rollout.offload);
    # the stacked projections (vlmrl.engine.rollout.stacked) take about as much in rollouts, and their first
    # factors' rows always.
    # Neither under FSDP / DeepSpeed on several GPUs (vlmrl.engine.rollout.fast.sharded).
    unsharded = gpus == 1 or strategy == "ddp"
    adapters = adapters or ("stacked" if not config.model.load_in_4bit and unsharded else "as stored")
    stacked = fast_generation and adapters == "stacked"
    copies = fast_generation and adapters in ("stacked", "copies")
    fixed += lora * 1 if stacked else 0  # the first factors' rows (A is about half of LoRA's parameters)
    rollout_fixed = fixed - lora * (optimizer_bytes - 8) + lora * 2 if copies else fixed + rollout_weights - resident
    prompt_cache = generation_batch * prompt_tokens * kv_per_token
    # a measured excess of the compiled decode phase, about one prompt-sized cache (see the docstring)
    decode = kv + prompt_cache if fast_generation else kv
    generation_phase = rollout_fixed + max(decode, prompt_cache + prefill)
    training_phase = fixed + training
    peak = max(generation_phase, training_phase)
    return MemoryEstimate(
        weights_gib=resident / GIB,
        lora_and_optimizer_gib=lora_state / GIB,
        kv_cache_gib=kv / GIB,
        prefill_gib=prefill / GIB,
        training_gib=training / GIB,
        peak_gib=peak / GIB,
        host_ram_gib=(language + vision) * 2 / GIB + 4,
    )


def _per_gpu(text: dict, weights: float, quantized: float, lora_state: float, optimizer_bytes: int, gpus: int,
             strategy: str) -> tuple[float, float, float]:
    """Bytes on each GPU: (weights outside rollouts, weights in rollouts, LoRA weights + optimizer state)."""
    if gpus > 1 and strategy in ("fsdp", "zero3"):
        # 1/N of the weights (bitsandbytes' uint8 4-bit storage stays whole: accelerate leaves it out of FSDP2),
        # plus what is gathered at a time: the block in use and the next one, prefetched, and the LM head, which
        # accelerate's tail unit keeps gathered through the step
        head = text["vocab_size"] * text["hidden_size"]
        block = 0 if quantized else (language_param_count(text) - head) / text["num_hidden_layers"] * 2
        resident = quantized + (weights - quantized) / gpus + 2 * block + head * 2
        # ZeRO-3: TRL gathers the whole model for generation (ds3_gather_for_generation); FSDP2 gathers block by
        # block at every forward, token steps included
        return resident, resident + weights if strategy == "zero3" else resident, lora_state / gpus
    if gpus > 1 and strategy == "zero2":  # gradients and Adam's moments 1/N; the fp32 LoRA weights whole
        return weights, weights, lora_state * (4 + (optimizer_bytes - 4) / gpus) / optimizer_bytes
    return weights, weights, lora_state


SMALL_CARD_GIB = 17.0  # a 16 GB card reports about 15 GiB


def advice(estimate: MemoryEstimate, gpu_gib: float | None, config: Config, *, shapes: dict | None = None,
           prompt_tokens: int | None = None) -> list[str]:
    """What to change when the prediction does not fit (empty when it fits or there is no GPU to compare). With
    the model's `shapes` and the prompt length, the first tip is the batching that keeps the step and fits."""
    if gpu_gib is None or estimate.peak_gib <= GPU_MARGIN * gpu_gib:
        return []
    tips = []
    if gpu_gib <= SMALL_CARD_GIB and f"{config.run.name}-16gb" in PRESETS:
        tips.append(f"the {config.run.name}-16gb preset (vlmrl run {config.run.name}-16gb): the same recipe cut to "
                    "fit a 16 GB card")
    fit = fit_batching(config, shapes, gpu_gib, prompt_tokens) if shapes and prompt_tokens else None
    if fit is not None:
        t = config.train
        tips.append(f"the same {t.per_device_train_batch_size * t.gradient_accumulation_steps} completions per "
                    f"optimizer step in smaller pieces: train.per_device_train_batch_size={fit.per_device}, "
                    f"train.gradient_accumulation_steps={fit.accumulation}, "
                    f"train.steps_per_generation={fit.steps_per_generation} (predicted {fit.peak_gib:.1f} GiB)")
    if not config.model.load_in_4bit:
        tips.append("model.load_in_4bit=true (weights to about a quarter)")
    if estimate.kv_cache_gib > 0.2 * estimate.peak_gib:
        tips.append("a smaller train.max_completion_length or fewer completions per step "
                    "(per_device_train_batch_size) — the rollout KV cache is "
                    f"{estimate.kv_cache_gib:.1f} GiB")
    if not config.train.gradient_checkpointing:
        tips.append("train.gradient_checkpointing=true")
    if "8bit" not in config.train.optim:
        tips.append("train.optim=adamw_8bit")
    return [f"predicted peak {estimate.peak_gib:.1f} GiB exceeds this GPU ({gpu_gib:.1f} GiB); try: " + "; ".join(tips)]


@dataclass(frozen=True)
class Batching:
    """How one optimizer step's completions are cut: per micro-step, micro-steps per step and per rollout."""

    per_device: int
    accumulation: int
    steps_per_generation: int
    peak_gib: float


def fit_batching(config: Config, shapes: dict, gpu_gib: float, prompt_tokens: int, *,
                 fast_generation: bool = True) -> Batching | None:
    """The batching of one GPU that keeps the config's completions per optimizer step (per_device x accumulation)
    and whose predicted peak fits GPU_MARGIN of `gpu_gib`: the largest micro-batch up to the configured one first
    (fewer, larger matmuls in the loss pass), then the largest rollout up to the configured one (a larger rollout
    decodes faster); each rollout holds whole groups and each step whole rollouts. The configured batching when
    it fits. None when nothing fits, even one completion at a time (long
    completions then need a larger card, a smaller model or a shorter limit).

    >>> from vlmrl.config.schema import load_config
    >>> seed = load_config("seed", ["train.max_completion_length=8192"])
    >>> fit = fit_batching(seed, load_shapes("qwen3_vl_8b"), 24.0, 310)
    >>> fit.per_device, fit.accumulation, fit.steps_per_generation, round(fit.peak_gib)
    (2, 16, 4, 18)
    """
    t = config.train
    step = t.per_device_train_batch_size * t.gradient_accumulation_steps
    rollout = t.per_device_train_batch_size * (t.steps_per_generation or t.gradient_accumulation_steps)
    for per_device in [d for d in range(t.per_device_train_batch_size, 0, -1) if step % d == 0]:
        accumulation = step // per_device
        for spg in [d for d in range(accumulation, 0, -1) if accumulation % d == 0]:
            if (per_device * spg) % t.num_generations or per_device * spg > rollout:
                continue
            train = t.model_copy(update={"per_device_train_batch_size": per_device,
                                         "gradient_accumulation_steps": accumulation, "steps_per_generation": spg})
            peak = estimate_memory(config.model_copy(update={"train": train}), shapes, prompt_tokens=prompt_tokens,
                                   fast_generation=fast_generation).peak_gib
            if peak <= GPU_MARGIN * gpu_gib:
                return Batching(per_device, accumulation, spg, peak)
    return None


@dataclass(frozen=True)
class BatchChoice:
    """What `train.auto_batch` chose, and why: recorded in the run folder (train/auto_batch.json)."""

    per_device_train_batch_size: int
    configured: int
    gpu_gib: float | None
    predicted_peak_gib: float | None
    note: str

    def as_dict(self) -> dict:
        return asdict(self)


def with_batch(config: Config, batch: int) -> Config:
    return config.model_copy(update={"train": config.train.model_copy(update={"per_device_train_batch_size": batch})})


def choose_batch(config: Config, shapes: dict, *, gpu_gib: float, max_batch: int) -> BatchChoice:
    """The largest per_device_train_batch_size, a multiple of num_generations and at most `max_batch`, whose
    predicted peak (prompts at data.max_prompt_tokens, the longest the data keeps) fits GPU_MARGIN of the card.
    The prediction grows with the batch, so the search walks up until it no longer fits."""
    t = config.train
    step = t.num_generations
    fast = t.rollout.fast != "never"

    def peak(batch: int) -> float:
        return estimate_memory(with_batch(config, batch), shapes, prompt_tokens=config.data.max_prompt_tokens,
                               fast_generation=fast).peak_gib

    best = None
    batch = step
    while batch <= max_batch and peak(batch) <= GPU_MARGIN * gpu_gib:
        best, batch = batch, batch + step
    if best is None:
        return BatchChoice(t.per_device_train_batch_size, t.per_device_train_batch_size, gpu_gib,
                           peak(t.per_device_train_batch_size),
                           f"train.auto_batch: even {step} completions per device are predicted to exceed "
                           f"{GPU_MARGIN:.0%} of this GPU's {gpu_gib:.0f} GiB; per_device_train_batch_size stays "
                           f"{t.per_device_train_batch_size}")
    limit = "the data" if best + step > max_batch else "memory"
    return BatchChoice(best, t.per_device_train_batch_size, gpu_gib, peak(best),
                       f"train.auto_batch: per_device_train_batch_size {t.per_device_train_batch_size} -> {best} "
                       f"(predicted peak {peak(best):.1f} of {gpu_gib:.0f} GiB; limited by {limit})")


def auto_batch(config: Config, max_batch: int) -> BatchChoice | None:
    """`choose_batch` for this machine's GPU; None when train.auto_batch is off; no change without a CUDA GPU or
    without the model's shapes (a one-line note says which)."""
    import torch

    t = config.train
    if not t.auto_batch:
        return None
    unchanged = t.per_device_train_batch_size
    if not torch.cuda.is_available():
        return BatchChoice(unchanged, unchanged, None, None,
                           f"train.auto_batch: no CUDA GPU here; per_device_train_batch_size stays {unchanged}")
    shapes = shapes_for(config.model.name)
    if shapes is None:
        return BatchChoice(unchanged, unchanged, None, None,
                           f"train.auto_batch: no config.json or shipped shapes for {config.model.name!r} to predict "
                           f"memory from; per_device_train_batch_size stays {unchanged}")
    device = int(os.environ.get("LOCAL_RANK", "0"))  # the process group is not set up yet
    gpu_gib = torch.cuda.get_device_properties(device).total_memory / GIB
    return choose_batch(config, shapes, gpu_gib=gpu_gib, max_batch=max_batch)


def shape_names() -> list[str]:
    """The shipped shapes files (`vlmrl/preflight/shapes/*.json`), by the name `load_shapes` and `vlmrl bench --shapes`
    take."""
    return sorted(f.name.removesuffix(".json") for f in resources.files("vlmrl.preflight.shapes").iterdir()
                  if f.name.endswith(".json"))


def load_shapes(name: str) -> dict:
    text = resources.files("vlmrl.preflight.shapes").joinpath(f"{name}.json").read_text()
    return json.loads(text)


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
