"""The fast rollout path: TRL's own `generate` call, with a static KV cache and a compiled decode step.

Generation dominates an RL step (DESIGN.md: plain TRL spends most of a 24-32 s step decoding at ~85 ms per
token for an 8B VLM). Hugging Face `generate` can decode with a static KV cache and a `torch.compile`d
forward (4.6x faster per token on an H200), but TRL builds its GenerationConfig with
`disable_compile=True`, so setting `cache_implementation="static"` in GRPOConfig alone changes nothing
(measured: no gain). We switch compilation back on, on the trainer's own GenerationConfig, after the
trainer is built; TRL's loop, masks, rewards and loss are untouched.

Compiled decoding recompiles for every new cache shape. The decode step's shapes depend on the static cache's
length (prompt + `max_new_tokens` - 1), not on the prompt's (transformers builds the decode masks outside the
compiled graph), so the cache length is rounded up to a multiple of `bucket` tokens (`bucket_static_cache`) and
the prompts themselves are not padded: the loss pass sees exactly the tokens plain TRL's does. transformers
keeps the largest cache length seen, so a run compiles once per new bucket, typically once or twice. The same
settings serve `vlmrl eval`. (Where transformers has no `_prepare_static_cache` to wrap, prompts are padded
to the bucket instead, through TRL's `pad_to_multiple_of`.)

Under compilation transformers' SDPA path copies the keys and values once per query head group
(`repeat_kv`) at every token step; `vlmrl.engine.rollout.attention` swaps in `vlmrl_sdpa`, which folds the query heads
instead (same attention, no copies); at token steps it runs vlmrl's Triton kernel, which reads only the cache
blocks some position of which is attended (`vlmrl.engine.rollout.decode_attention`, `train.rollout_decode_kernel`; 13.0 ->
12.4 ms per token step in TRL on an H200). See docs/benchmarks.md for what each piece is worth on an H200.

PEFT keeps LoRA weights in float32 next to a bf16 base (`autocast_adapter_dtype`), and TRL's loss pass runs
under the accelerator's bf16 autocast, but its `generate` does not: every adapter matmul of a rollout then
runs in float32 (244 float32 GEMMs per token step in an H200 profile) and each LoRA output is added to the
bf16 base output in float32. Rollouts therefore run under the same bf16 autocast as the loss pass, so the
adapter's matmuls match the numerics the policy is trained with. Measured on an H200: peak memory 0.5 GiB
lower; decode time unchanged (22.5 vs 22.1 ms per token step), since the adapters' cost there (about 6 ms of
it) is the number of small kernels, not their precision. Merging the adapter for the
rollout removes that cost (`vlmrl.engine.rollout.merge`: exact restore from a pinned host copy; 19.9 -> 14.3 ms per token
step outside TRL, on an H200), but it is opt-in (`train.rollout_merge`): bf16 rounding drops small adapter
deltas from the rollout policy.

The host does not wait for the device between token steps (except under FSDP / ZeRO-3, where `generate`
all-reduces the stop flag at every step): transformers' decode loop reads its stop flag on
the host after every token, which stalls the host until the GPU has finished that step, so the next step's
dynamo guard checks, launch and sampling ops ran while the GPU sat idle. transformers has a check that reads
the flag one step late (`DeferredStopCheck`) but turns it on for Apple GPUs only; rollouts and compiled
evaluation turn it on for CUDA (`deferred_stop_check`). Measured on an H200, Qwen3-VL-8B shapes, batch 32:
18.96 -> 12.51 ms per token step (`benchmarks/decode_variants.py`). The float32 adapter weights can also be
read from bf16 copies made once per rollout instead of cast at every token step (`vlmrl.engine.rollout.adapter_cast`,
`train.rollout_adapter_copies`: 12.51 -> 11.63 ms); the copies exist only while a rollout runs, and the optimizer
state waits on the host meanwhile (`vlmrl.engine.rollout.offload`), so the step's peak memory does not grow.

Memory: a static cache is allocated in full before the prompt pass, so that pass's temporaries (the last
layer's MLP and projections over every prompt token, plus the prompt embeddings and vision features) would sit
on top of the whole cache: the rollout's peak, 1.9 GiB above plain TRL's on an H200. The prompt pass therefore
fills a dynamic cache, which is then moved layer by layer into the static cache the compiled decode steps use
(`prefill_into_dynamic_cache`). The peak becomes the full cache plus one decode step, as with plain TRL
(measured: rollout peak 25.8 -> 23.9 GiB; the whole step's peak now equals plain TRL's).

vlmrl_sdpa, the merge, the adapter copies, the optimizer state's move, the autocast and the deferred stop check
apply for the duration of each rollout only: the loss pass computes what plain TRL's does (`vlmrl.engine.loss_pass` and
`vlmrl.engine.adapter_inputs` change how, not what).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FastGeneration:
    enabled: bool
    reason: str
    bucket: int | None = None
    mode: str | None = None
    attention: str | None = None
    autocast: str | None = None
    merge: str | None = None  # "merged" or why not
    prefill: str | None = None  # "dynamic cache, then static" or why not
    stop_check: str | None = None  # "deferred one step" or why not
    adapters: str | None = None  # how the rollout reads the LoRA weights
    cache_read: str | None = None  # which static-cache positions a token step's attention reads
    guards: str | None = None  # when compiled token steps check dynamo's guards

    def as_dict(self) -> dict:
        return {"enabled": self.enabled, "reason": self.reason, "bucket": self.bucket, "mode": self.mode,
                "attention": self.attention, "autocast": self.autocast, "merge": self.merge, "prefill": self.prefill,
                "stop_check": self.stop_check, "adapters": self.adapters, "cache_read": self.cache_read,
                "guards": self.guards}


def wanted(setting: str) -> bool:
    """`auto` means on for CUDA (compilation costs more than it saves on the CPU for small models)."""
    return setting == "always" or (setting == "auto" and torch.cuda.is_available())


def enable_fast_generation(
    trainer: Any, *, bucket: int = 64, mode: str = "reduce-overhead", all_devices: bool = False, merge: bool = False,
    adapter_copies: bool = False, filled_window: int = 0, decode_kernel: bool = False, stacked: bool = False,
    stacked_kernel: bool = False, guards: str = "every step",
) -> FastGeneration:
    """Turn on static-cache + compiled decoding inside a built `GRPOTrainer`. `filled_window` > 0: each token
    step's attention reads only the filled cache positions, rounded up to that many (`attend_filled`).
    `decode_kernel`: token steps' attention runs `vlmrl.engine.rollout.decode_attention`, which skips the cache blocks
    nothing attends to (needs vlmrl_sdpa and Triton). `stacked`: projections that read the same input run as one
    matmul with their adapters' first factors (`vlmrl.engine.rollout.stacked`; moves the base weights once, here);
    `stacked_kernel`: their second step runs as one Triton kernel at token steps (`vlmrl.engine.rollout.second_factors`).
    `guards="first step"`: each `generate` call's later token steps skip dynamo's guard checks (`guards_once`)."""
    config = getattr(trainer, "generation_config", None)
    if config is None or getattr(trainer, "use_vllm", False):
        return FastGeneration(False, "the trainer generates with vLLM, which has its own fast path")
    if getattr(trainer, "use_transformers_continuous_batching", False):
        return FastGeneration(False, "continuous batching is configured; it manages its own cache")
    from vlmrl.engine.rollout.attention import NAME, packed_gqa, packed_gqa_applies
    from vlmrl.engine.rollout.attention import decode_kernel as decode_kernel_context

    config.disable_compile = False
    config.cache_implementation = "static"
    config.compile_config = _compile_config(mode, all_devices)
    trainer.generation_kwargs["cache_implementation"] = "static"
    if not bucket_static_cache(trainer.model, bucket):
        trainer.pad_to_multiple_of = bucket
    prefill = prefill_into_dynamic_cache(trainer.model)
    merger, merge_note = _rollout_merge(trainer) if merge else (None, "not merged (train.rollout_merge=false)")
    dtype = rollout_autocast_dtype(trainer.model, trainer.args)
    attention = NAME if packed_gqa_applies(trainer.model) else None
    stack, stack_note = _stacked(trainer, dtype, wanted=stacked and merger is None)
    copies, adapters = _adapter_copies(trainer, dtype, wanted=adapter_copies and merger is None and stack is None)
    if stack_note:
        adapters = stack_note if stack is not None else f"{stack_note}; {adapters}"
    if stack is not None and stacked_kernel:
        adapters += "; token steps: each group's second step one Triton kernel (vlmrl.engine.rollout.second_factors)"
    offload = None
    if copies is not None or stack is not None:
        from vlmrl.engine.rollout.offload import OptimizerStateOffload

        offload = OptimizerStateOffload(trainer)
    stop_check = stop_check_note()
    window = filled_window if attention and filled_window > 0 else 0
    kernel, kernel_note = _decode_kernel_note(wanted=decode_kernel, attention=attention is not None)
    cache_read = (f"filled positions, rounded up to {window}" if window else
                  "the whole static cache" + (" (train.rollout_filled_window needs vlmrl_sdpa)"
                                              if filled_window > 0 else "")) + kernel_note
    _wrap_rollouts(trainer, [
        (lambda: packed_gqa(trainer.model)) if attention else None,
        (lambda: attend_filled(trainer.model, window)) if window else None,
        decode_kernel_context if kernel else None,
        merger.merged if merger else None,
        offload.active if offload else None,  # frees the optimizer state's memory before the copies take theirs
        copies.active if copies else None,
        (lambda: stack.active(fused=stacked_kernel)) if stack else None,
        # cache_enabled=False: autocast would otherwise hold a bf16 copy of every fp32 LoRA weight for the whole
        # rollout (0.08 GiB for Qwen3-VL-8B at r=16, the rollout peak's excess over the merged path's).
        (lambda: torch.autocast(device_type=_device_type(), dtype=dtype, cache_enabled=False))
        if dtype is not None else None,
        deferred_stop_check,
        (lambda: guards_once(trainer.model)) if guards == "first step" else None,
        lambda: compile_over_4bit(trainer.model),
    ])
    log.info("fast generation: static KV cache + torch.compile(mode=%s), cache bucketed to %d, attention %s, "
             "autocast %s, adapter %s, adapter weights %s, prefill %s, stop check %s, attention reads %s, guards "
             "checked at %s", mode, bucket, attention or "unchanged", dtype, merge_note, adapters, prefill, stop_check,
             cache_read, guards)
    return FastGeneration(True, "static KV cache + torch.compile", bucket, mode, attention,
                          _dtype_name(dtype) if dtype is not None else None, merge_note, prefill, stop_check, adapters,
                          cache_read, guards)


def _adapter_copies(trainer: Any, dtype: torch.dtype | None, *, wanted: bool) -> tuple[Any, str]:
    """The bf16 adapter copies for rollouts (`vlmrl.engine.rollout.adapter_cast`) when asked for and useful, and what was done."""
    if dtype is None:
        return None, "as stored (no float32 adapters over a low-precision base)"
    cast = f"float32, cast to {_dtype_name(dtype)} at each token step"
    if not wanted:
        return None, cast
    if _sharded(trainer):
        # accelerate shards (and replaces) the parameters after this point; copies of them would go stale
        return None, f"{cast} (no copies: parameters are sharded by FSDP / DeepSpeed)"
    from vlmrl.engine.rollout.adapter_cast import LowPrecisionAdapters

    copies = LowPrecisionAdapters(trainer.model, dtype)
    return copies, (f"{_dtype_name(dtype)} copies made per rollout ({copies.nbytes / 2**30:.2f} GiB while it runs; "
                    "the optimizer state waits on the host)")


def _stacked(trainer: Any, dtype: torch.dtype | None, *, wanted: bool) -> tuple[Any, str | None]:
    """The stacked projections for rollouts (`vlmrl.engine.rollout.stacked`) when asked for and possible, and what was done
    or why not (None when not asked for)."""
    if not wanted:
        return None, None
    refused = "not stacked ({})"
    if _sharded(trainer):
        return None, refused.format("parameters are sharded by FSDP / DeepSpeed")
    base_dtypes = {p.dtype for p in trainer.model.parameters() if not p.requires_grad and p.is_floating_point()}
    adapter_dtypes = {p.dtype for p in trainer.model.parameters() if p.requires_grad}
    if dtype is None and adapter_dtypes - base_dtypes:  # float32 adapters, no rollout autocast to match them
        return None, refused.format("the adapters' dtype differs from the base's and rollouts run without autocast")
    from vlmrl.engine.rollout.stacked import StackedProjections

    stack = StackedProjections(trainer.model)
    if not stack.groups:
        return None, refused.format(stack.reason)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the base weights' old places
    sizes = sorted({len(g.layers) for g in stack.groups}, reverse=True)
    return stack, (f"stacked by shared input for rollouts ({len(stack.groups)} groups of {'/'.join(map(str, sizes))} "
                   f"projections; first factors' rows {stack.nbytes / 2**30:.2f} GiB kept, second factors "
                   f"{stack.second_nbytes() / 2**30:.2f} GiB while it runs; the optimizer state waits on the host)")


def _decode_kernel_note(*, wanted: bool, attention: bool) -> tuple[bool, str]:
    """Whether rollouts run the decode kernel, and what the cache-read note adds about it."""
    from vlmrl.engine.rollout.decode_attention import HAS_TRITON

    if not wanted:
        return False, ""
    if not attention:
        return False, " (train.rollout_decode_kernel needs vlmrl_sdpa)"
    if not HAS_TRITON:
        return False, " (train.rollout_decode_kernel needs Triton)"
    return True, "; token steps skip the blocks nothing attends to (vlmrl.engine.rollout.decode_attention)"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sharded(trainer: Any) -> bool:
    """FSDP or DeepSpeed: accelerate shards (and replaces) the parameters when training starts."""
    return bool(getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False))


def stop_check_note() -> str:
    if _deferred_stop_check_class() is None:
        return "every step: this transformers has no DeferredStopCheck"
    # transformers' own conditions still apply (no assistant model; a returned cache must be croppable), and
    # with synced GPUs (FSDP / ZeRO-3) its per-step all-reduce of the stop flag still waits on the device.
    return "deferred one step on CUDA"


def _deferred_stop_check_class() -> Any:
    try:
        from transformers.generation.utils import DeferredStopCheck
    except ImportError:
        return None
    return DeferredStopCheck if isinstance(DeferredStopCheck.__dict__.get("is_supported"), staticmethod) else None


def _rollout_merge(trainer: Any) -> tuple[Any, str]:
    from vlmrl.engine.rollout.merge import RolloutMerge, available_host_bytes, host_bytes, unsupported_reason

    if _sharded(trainer):
        return None, "not merged: parameters are sharded (FSDP / DeepSpeed)"
    reason = unsupported_reason(trainer.model)
    if reason:
        return None, f"not merged: {reason}"
    need, free = host_bytes(trainer.model), available_host_bytes()
    copies = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # every process on this host pins its own copy
    if free is not None and need * copies > free // 2:
        return None, (f"not merged: {copies} pinned copies of {need / 2**30:.1f} GiB exceed half the free host "
                      "memory")
    merger = RolloutMerge(trainer.model)
    try:
        merger.keep_originals()
    except (RuntimeError, MemoryError) as exc:  # pinning can fail where locked memory is limited
        return None, f"not merged: the host copy could not be made ({type(exc).__name__}: {exc})"[:300]
    log.warning("rollouts sample from merged bf16 weights: adapter deltas below half a bf16 step of their weight "
                "are lost in rollouts (vlmrl.engine.rollout.merge)")
    return merger, f"merged for rollouts (host copy {need / 2**30:.1f} GiB)"


def _wrap_rollouts(trainer: Any, contexts: list[Callable[[], Any] | None]) -> None:
    """Run each of TRL's rollout calls inside `contexts` (factories, entered in order; None skipped). Wrapping
    again replaces the earlier wrapper rather than nesting in it."""
    inner = trainer._generate_single_turn
    inner = getattr(inner, "_vlmrl_inner", inner)
    active = [c for c in contexts if c is not None]

    def generate(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for factory in active:
                stack.enter_context(factory())
            return inner(*args, **kwargs)

    generate._vlmrl_inner = inner
    trainer._generate_single_turn = generate


@contextlib.contextmanager
def deferred_stop_check(device_types: tuple[str, ...] = ("cuda",)) -> Iterator[None]:
    """Let `generate` read its stop flag one token step late on `device_types`, inside the block.

    transformers' decode loop checks after every token whether all sequences are done (`unfinished.max() == 0`
    read on the host), which makes the host wait for the device at every step: the next step's launch, its
    dynamo guard checks and the sampling ops are then never overlapped with GPU work. transformers 5.x has
    `DeferredStopCheck`, which copies the flag asynchronously and reads it one step later (undoing the one extra
    step at the end), but enables it only on Apple GPUs. This turns it on for CUDA; a length limit still stops
    on time (it is checked on the host). transformers' other conditions are kept (no assistant model; a cache
    that is returned must be croppable). With synced GPUs (FSDP / ZeRO-3) `generate` still all-reduces the stop
    flag on the device at every step, so the host waits there anyway. No-op where transformers has no
    `DeferredStopCheck`.
    """
    DeferredStopCheck = _deferred_stop_check_class()
    if DeferredStopCheck is None:
        yield
        return
    original = DeferredStopCheck.__dict__["is_supported"]

    def is_supported(device: torch.device, *args: Any, **kwargs: Any) -> bool:
        # Its own conditions (returned cache croppable, not an assistant model), as if on the device it allows.
        return original.__func__(torch.device("mps") if device.type in device_types else device, *args, **kwargs)

    DeferredStopCheck.is_supported = staticmethod(is_supported)
    try:
        yield
    finally:
        DeferredStopCheck.is_supported = original


@contextlib.contextmanager
def attend_filled(model: Any, window: int) -> Iterator[None]:
    """Inside the block, each token step on a static cache tells `vlmrl_sdpa` how many leading cache positions
    can be attended to: the tokens so far (the step's own included), rounded up to `window`, at most the cache.

    Wraps the model's `prepare_inputs_for_generation`, which `generate` calls on the host before every step with
    all tokens so far, so the length is known without reading the device. It travels as the size of a view of one
    buffer (`FILLED`), marked dynamic: a compiled decode step takes it as a symbolic size rather than recompiling
    for each value, and CUDA graphs record one graph per window (cache length / window of them at most).
    """
    from vlmrl.engine.rollout.attention import FILLED, base_model

    base = base_model(model)
    original = base.prepare_inputs_for_generation
    buffers: dict[tuple[torch.device, int], torch.Tensor] = {}

    def prepare(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        inputs = original(input_ids, *args, **kwargs)
        key = _cache_key(inputs)
        length = _static_cache_length(inputs[key] if key else None)
        if length is None:
            return inputs
        filled = min(-(-input_ids.shape[1] // window) * window, length)
        buffer = (input_ids.device, length)
        if buffer not in buffers:
            buffers[buffer] = torch.empty(length, dtype=torch.uint8, device=input_ids.device)
        view = buffers[buffer][:filled]
        torch._dynamo.maybe_mark_dynamic(view, 0)
        inputs[FILLED] = view
        return inputs

    with _replaced(base, "prepare_inputs_for_generation", prepare):
        yield


@contextlib.contextmanager
def _replaced(obj: Any, name: str, value: Any) -> Iterator[None]:
    """`obj.name` is `value` inside the block; afterwards the instance's own attribute again, or none (the class's)."""
    own = name in vars(obj)
    original = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


def _cache_key(model_kwargs: dict) -> str | None:
    """Where `generate` keeps its cache among the model's keyword arguments: `cache` in transformers after 5.17,
    `past_key_values` up to it."""
    return next((k for k in ("cache", "past_key_values") if k in model_kwargs), None)


def _full_attention_static(cache: Any) -> bool:
    """A static cache of full-attention layers only (sliding-window layers keep their own length)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    return isinstance(cache, StaticCache) and all(type(layer) is StaticLayer for layer in cache.layers)


def _static_cache_length(cache: Any) -> int | None:
    """The length of a static cache of full-attention layers only; None for any other cache."""
    if not _full_attention_static(cache) or not cache.layers:
        return None
    lengths = {layer.max_cache_len for layer in cache.layers}
    return lengths.pop() if len(lengths) == 1 else None


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def bucket_static_cache(model: Any, bucket: int) -> bool:
    """Round every static cache `generate` builds for `model` up to a multiple of `bucket` positions.

    Wraps the model's `_prepare_static_cache` (transformers 5.x); False when there is none to wrap."""
    from vlmrl.engine.rollout.attention import base_model

    base = base_model(model)
    original = getattr(base, "_prepare_static_cache", None)
    if original is None:
        return False
    original = getattr(original, "_vlmrl_original", original)

    def prepare(cache_implementation: str, batch_size: int, max_cache_len: int, *args: Any, **kwargs: Any) -> Any:
        return original(cache_implementation, batch_size, -(-max_cache_len // bucket) * bucket, *args, **kwargs)

    prepare._vlmrl_original = original
    base._prepare_static_cache = prepare
    return True


def prefill_into_dynamic_cache(model: Any) -> str:
    """Make `generate` run the prompt pass on a dynamic cache and then move it into its (empty) static cache.

    Wraps the model's `_prefill` (transformers' generation internals, 5.x). Applies when the static cache has only
    full-attention layers and is empty; anything else (sliding-window layers, chunked prefill, a cache that is
    already filled, another transformers layout) takes the original path. Returns what it did.
    """
    from vlmrl.engine.rollout.attention import base_model

    base = base_model(model)
    original = getattr(base, "_prefill", None)
    if original is None:
        return "unchanged: this transformers has no `_prefill` to wrap"
    if getattr(original, "_vlmrl_wrapped", False):
        return "dynamic cache, then static"

    def prefill(input_ids: Any, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
        key = _cache_key(model_kwargs)
        static = model_kwargs.get(key) if key else None
        if getattr(generation_config, "prefill_chunk_size", None) or not _empty_full_attention_static(static):
            return original(input_ids, generation_config, model_kwargs, *args, **kwargs)
        from transformers import DynamicCache

        model_kwargs[key] = DynamicCache(config=base.config.get_text_config(decoder=True))
        try:
            outputs = original(input_ids, generation_config, model_kwargs, *args, **kwargs)
            dynamic = model_kwargs[key]
        finally:
            model_kwargs[key] = static
        if len(dynamic.layers) != len(static.layers):
            raise RuntimeError(f"prompt pass filled {len(dynamic.layers)} cache layers, the static cache has "
                               f"{len(static.layers)}")
        for source, target in zip(dynamic.layers, static.layers):
            target.update(source.keys, source.values)  # allocates the static layer, copies the prompt positions
            source.keys = source.values = None  # one layer of prompt keys/values extra at a time
        outputs[key] = static
        return outputs

    prefill._vlmrl_wrapped = True
    base._prefill = prefill
    return "dynamic cache, then static"


def _empty_full_attention_static(cache: Any) -> bool:
    return (
        _full_attention_static(cache)
        and not getattr(cache, "offloading", False)  # the move below bypasses the offloading hooks
        and int(cache.get_seq_length()) == 0
    )


@contextlib.contextmanager
def compile_over_4bit(model: Any) -> Iterator[None]:
    """Let transformers compile decoding over a bitsandbytes 4-bit base, for the duration of the block.

    transformers refuses to compile `generate` for any quantizer whose `is_compileable` is False, which the
    bitsandbytes 4-bit quantizer inherits; it then decodes eagerly over the static cache, one kernel launch per
    projection and the host waiting on each (the 4-bit path ran at 143 ms per token step on an H200, its
    matmuls needing ~22). bitsandbytes >= 0.50 runs inference matmuls through registered torch ops
    (`bitsandbytes::gemm_4bit`, with fake implementations), which dynamo traces, so the refusal is lifted when
    that op exists. Without gradients bitsandbytes takes the same op eagerly, so the rollout's numerics are
    those of bitsandbytes' own inference path either way (benchmarks/decode_4bit.py compares the rollout's
    log-probs with the loss pass's).
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or quantizer.is_compileable or not bnb_ops_traceable():
        yield
        return
    original = type(quantizer)
    quantizer.__class__ = _compileable(original)
    try:
        yield
    finally:
        quantizer.__class__ = original


@functools.cache
def _compileable(quantizer_class: type) -> type:
    """The quantizer's class with `is_compileable` True: made once, not at every rollout."""
    return type(f"Compileable{quantizer_class.__name__}", (quantizer_class,), {"is_compileable": True})


@functools.cache
def bnb_ops_traceable() -> bool:
    """Whether bitsandbytes registers its 4-bit inference matmul as a torch op (0.50 and later)."""
    try:
        import bitsandbytes  # noqa: F401  registers torch.ops.bitsandbytes
    except Exception:  # noqa: BLE001  missing or broken install: nothing to lift
        return False
    return hasattr(torch.ops.bitsandbytes, "gemm_4bit")


def rollout_autocast_dtype(model: Any, args: Any) -> torch.dtype | None:
    """The training autocast dtype when rollouts need it: a bf16/fp16 run whose trainable (adapter) weights are
    float32 while the frozen base is not. None otherwise (full-precision runs, adapters already in bf16)."""
    dtype = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) else None
    if dtype is None:
        return None
    params = list(model.parameters())
    trainable_fp32 = any(p.requires_grad and p.dtype == torch.float32 for p in params)
    frozen_low = any(not p.requires_grad and p.dtype in (torch.bfloat16, torch.float16) for p in params)
    return dtype if trainable_fp32 and frozen_low else None


@contextlib.contextmanager
def guards_once(model: Any) -> Iterator[None]:
    """Inside the block, the compiled token steps of each `generate` call check dynamo's guards until one of them
    compiles nothing; the later steps of the call run under `torch.compiler.set_stance(skip_guard_eval_unsafe=True)`.

    Dynamo checks, before every call of a compiled function, thousands of guards on the model's attributes and
    inputs (about 270 per Qwen3-VL layer); at Qwen3-VL-8B shapes on an H200 that took 6.1 ms of host time per
    token step (`TorchDynamo Cache Lookup`), more than half of a token step, which the GPU cannot hide once its
    own work per step is as short. Within one `generate` call nothing they check changes from one token step to
    the next once the steps are steady: the static cache, the batch and every shape are fixed for the call. The
    first steps check everything (and compile when something did change, e.g. a new cache length, or a first token
    step that differs from the later ones), so only steady repeats are skipped; torch still checks the guards that
    tell its compiled entries apart. Should a skipped step still need a graph that is not compiled (torch raises
    instead of compiling under that stance), the step runs again with its guards checked, and so does the rest of
    the call: a token step is a pure function of its inputs and the cache positions it writes, so running it again
    writes the same values. Wraps the model's `get_compiled_call` (transformers 5.x), which `generate` calls once
    per call.
    """
    from torch._dynamo.utils import counters

    from vlmrl.engine.rollout.attention import base_model

    base = base_model(model)
    original = getattr(base, "get_compiled_call", None)
    if original is None:
        yield
        return

    def get_compiled_call(compile_config: Any) -> Callable:
        compiled = original(compile_config)
        steady = False  # a checked token step of this call compiled nothing
        fell_back = False  # a skipped step needed a new graph: the rest of the call checks every step

        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal steady, fell_back
            if steady and not fell_back:
                try:
                    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                        return compiled(*args, **kwargs)
                except RuntimeError as error:
                    if "skip_guard_eval_unsafe" not in str(error):
                        raise
                    fell_back = True
                    log.info("guards_once: a token step needed a graph not compiled yet; it ran again with its "
                             "guards checked, as will the rest of this generate call")
            compiles = counters["frames"]["total"]
            out = compiled(*args, **kwargs)
            steady = counters["frames"]["total"] == compiles
            return out

        return call

    with _replaced(base, "get_compiled_call", get_compiled_call):
        yield


def compile_settings(mode: str = "reduce-overhead", all_devices: bool = False) -> dict:
    """`generate` kwargs for the same path outside the trainer (evaluation)."""
    return {"cache_implementation": "static", "compile_config": _compile_config(mode, all_devices)}


def _compile_config(mode: str, all_devices: bool) -> Any:
    from transformers import CompileConfig

    # dynamic=False: shapes are bucketed, and a static graph is what CUDA graphs (reduce-overhead) replay.
    compile_config = CompileConfig(fullgraph=False, dynamic=False, mode=mode)
    compile_config._compile_all_devices = all_devices or None  # a class-level switch; set only for CPU tests
    return compile_config
