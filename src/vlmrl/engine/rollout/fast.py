"""The fast rollout path: TRL's own `generate` call, with a static KV cache and a compiled decode step.

TRL builds its GenerationConfig with `disable_compile=True`, so a static cache alone changes nothing. After the
trainer is built, `enable_fast_generation` switches compilation back on, on the trainer's own GenerationConfig,
and wraps each of TRL's rollout calls in a few contexts; TRL's loop, masks, rewards and loss are untouched. For
the duration of each rollout only:
- `vlmrl_sdpa` (`vlmrl.engine.rollout.attention`): grouped-query attention without copying the KV cache, and with
  `kernels`, vlmrl's Triton decode-attention kernel at token steps (`decode_attention`);
- the training autocast, so float32 adapters over a bf16 base compute as in the loss pass (`rollout_autocast_dtype`);
- the stacked LoRA projections (`stacked`, with `kernels` their second step as one Triton kernel, `second_factors`),
  or where they do not apply the bf16 adapter copies (`adapter_cast`), the optimizer state on the host meanwhile
  (`offload`); the record says which and why;
- with the decode kernel, rows that have ended read one block of their cache, not all of it (`finished`);
- the stop flag read one token step late on CUDA (`deferred_stop_check`), so the host does not wait for the GPU;
- each token step given only its own tokens' type ids (`step_inputs`), so that its shapes stay the same;
- a function dynamo stops recompiling, and so runs eagerly from then on, said at WARNING
  (`vlmrl.engine.recompiles`);
- compiling over a bitsandbytes 4-bit base where bitsandbytes' ops are traceable (`quantized_base`), whose
  token steps run vlmrl's nf4 kernel for the trainer's life where it applies (`quantized_base.nf4_token_steps`);
- each rollout's token step recorded once as one CUDA graph and replayed without dynamo (`step_graph`, compiled
  without CUDA graph trees; `step_graph_reason` says where it is on and why not elsewhere).
Once per trainer: the static cache's length rounded up to a multiple of `bucket` (`bucket_static_cache`: a
compile per new bucket, not per prompt length; prompts are not padded), and the prompt pass run on a dynamic
cache then moved into the static one (`prefill_into_dynamic_cache`: the rollout's peak stays plain TRL's).
`compile_settings` and `deferred_stop_check` serve compiled evaluation too (`vlmrl.engine.rollout.generation`).

The contexts are kept on the trainer (`trainer.vlmrl_rollout_contexts`, by name): what a rollout runs inside, which
`wrap_rollouts` replaces when called again. Left out: vLLM and continuous batching, which manage their own cache. What each piece is worth on an H200: benchmarks/NOTES.md ("What changed").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# What the record adds when token steps run vlmrl's kernels.
FINISHED_READ = ", and rows that have ended attend to their own position only (vlmrl.engine.rollout.finished)"
KERNEL_READ = "; token steps skip the blocks nothing attends to (vlmrl.engine.rollout.decode_attention)" + FINISHED_READ
SECOND_KERNEL = ("; token steps: each group's matmul and second step one Triton kernel where in_features is a "
                 "multiple of 128 (vlmrl.engine.rollout.group_step), else its second step one (second_factors)")
BRANCH_KERNEL = "; token steps: each projection's base and LoRA branch one nf4 kernel (vlmrl.engine.rollout.nf4_branch)"
STEP_GRAPH = "each rollout's token step recorded once as one CUDA graph and replayed (vlmrl.engine.rollout.step_graph)"
FIRST_FACTORS_ONLY = ", over the 4-bit base their first factors only"
GRAPH_TREES_BRANCH = "; PEFT's own branch over the 4-bit base with the graph trees"  # what follows the first factors
SECOND_KERNEL_FALLBACK = "; token steps: each group's second step on cuBLAS (the Triton kernel is bfloat16 only)"


@dataclass(frozen=True)
class FastGeneration:
    enabled: bool
    reason: str
    bucket: int | None = None
    mode: str | None = None
    attention: str | None = None
    autocast: str | None = None
    prefill: str | None = None  # "dynamic cache, then static" or why not
    stop_check: str | None = None  # "deferred one step" or why not
    adapters: str | None = None  # how the rollout reads the LoRA weights
    cache_read: str | None = None  # which static-cache positions a token step's attention reads
    weights: str | None = None  # how token steps read 4-bit base weights (None: not a 4-bit base)
    step_graph: str | None = None  # how token steps are launched: one recorded CUDA graph, or CUDA graph trees
    graphs: Any = dataclasses.field(default=None, repr=False, compare=False)  # the live `RolloutGraphs`, if on

    def as_dict(self) -> dict:
        """The record's fields; `step_graph` says so if the recorded step went back to CUDA graph trees since."""
        record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "graphs"}
        if self.graphs is not None and self.graphs.off is not None:
            record["step_graph"] = f"{self.step_graph}, then CUDA graph trees from a later rollout on ({self.graphs.off})"
            record["mode"] = f"{self.mode}, then {self.graphs.fallback_mode}"
            if self.adapters and FIRST_FACTORS_ONLY in self.adapters:
                record["adapters"] = self.adapters + GRAPH_TREES_BRANCH
        return record


def wanted(setting: str) -> bool:
    """`auto` means on for CUDA (compilation costs more than it saves on the CPU for small models)."""
    return setting == "always" or (setting == "auto" and torch.cuda.is_available())


def enable_fast_generation(
    trainer: Any, *, bucket: int = 64, kernels: bool = True, mode: str = "reduce-overhead", all_devices: bool = False,
) -> FastGeneration:
    """Turn on static-cache + compiled decoding inside a built `GRPOTrainer`, and say what was done.

    `kernels`: vlmrl's Triton kernels at token steps (decode attention, the stacked projections' second step). The
    LoRA projections are stacked where that applies and the adapter copies made where it does not."""
    config = getattr(trainer, "generation_config", None)
    if config is None or getattr(trainer, "use_vllm", False):
        return FastGeneration(False, "the trainer generates with vLLM, which has its own fast path")
    if getattr(trainer, "use_transformers_continuous_batching", False):
        return FastGeneration(False, "continuous batching is configured; it manages its own cache")
    from vlmrl.engine.recompiles import reported_recompile_limits
    from vlmrl.engine.rollout.attention import NAME, packed_gqa, packed_gqa_applies
    from vlmrl.engine.rollout.attention import decode_kernel as decode_kernel_context
    from vlmrl.engine.rollout.finished import finished_rows_read_one_block
    from vlmrl.engine.rollout.offload import OptimizerStateOffload
    from vlmrl.engine.rollout.quantized_base import compile_over_4bit, nf4_token_steps
    from vlmrl.engine.rollout.step_graph import RolloutGraphs
    from vlmrl.engine.rollout.step_inputs import step_token_inputs

    # Once per trainer: compilation on TRL's own GenerationConfig, over a bucketed static cache.
    config.disable_compile = False
    config.cache_implementation = "static"
    config.compile_config = _compile_config(mode, all_devices)
    trainer.generation_kwargs["cache_implementation"] = "static"
    if not bucket_static_cache(trainer.model, bucket):
        trainer.pad_to_multiple_of = bucket
    prefill = prefill_into_dynamic_cache(trainer.model)
    # What each rollout runs inside, and what the record says of each piece.
    dtype = rollout_autocast_dtype(trainer.model, trainer.args)
    attention = NAME if packed_gqa_applies(trainer.model) else None
    weights = nf4_token_steps(trainer, wanted=kernels)
    why_not = step_graph_reason(trainer, mode=mode, kernels=kernels, quantized=weights is not None)
    # over a 4-bit base the first factors are stacked where they were measured faster: on the recorded step
    stack, copies, adapters = _rollout_adapters(trainer, dtype, kernels=kernels, first_factors=why_not is None)
    offload = OptimizerStateOffload(trainer) if copies is not None or stack is not None else None
    kernel, cache_read = _cache_read(wanted=kernels, attention=attention is not None)
    graphs = RolloutGraphs(config) if why_not is None else None  # compiled without CUDA graph trees then
    mode = config.compile_config.mode
    contexts = [
        ("attention", (lambda: packed_gqa(trainer.model)) if attention else None),
        ("decode_kernel", decode_kernel_context if kernel else None),
        ("finished_rows", (lambda: finished_rows_read_one_block(trainer.model)) if kernel else None),
        ("offload", offload.active if offload else None),  # frees the optimizer state before the copies take theirs
        ("adapter_copies", copies.active if copies else None),
        # (over a 4-bit base, the first factors only while the token steps are recorded: `RolloutGraphs.off`)
        ("stacked", functools.partial(stack.active, fused=kernels,
                                      first_factors=(lambda: graphs.off is None) if graphs else None)
         if stack else None),
        # cache_enabled=False: autocast would otherwise hold a bf16 copy of every fp32 LoRA weight for the whole
        # rollout.
        ("autocast", (lambda: torch.autocast(device_type=_device_type(), dtype=dtype, cache_enabled=False))
         if dtype is not None else None),
        ("stop_check", deferred_stop_check),
        ("step_inputs", lambda: step_token_inputs(trainer.model)),
        ("recompiles", lambda: reported_recompile_limits(trainer)),
        ("step_graph", (lambda: graphs.active(trainer.model)) if graphs else None),
        ("compile_over_4bit", lambda: compile_over_4bit(trainer.model)),
    ]
    wrap_rollouts(trainer, [(name, factory) for name, factory in contexts if factory is not None])
    record = FastGeneration(True, "static KV cache + torch.compile", bucket=bucket, mode=mode, attention=attention,
                            autocast=_dtype_name(dtype) if dtype is not None else None, prefill=prefill,
                            stop_check=stop_check_note(), adapters=adapters, cache_read=cache_read, weights=weights,
                            step_graph=STEP_GRAPH if graphs else f"CUDA graph trees ({why_not})", graphs=graphs)
    log.info("fast generation: static KV cache + torch.compile(mode=%s), cache bucketed to %d, attention %s, "
             "autocast %s, adapter weights %s, prefill %s, stop check %s, attention reads %s, 4-bit weights %s, "
             "token steps: %s", mode, bucket, attention or "unchanged", dtype, adapters, prefill, record.stop_check,
             cache_read, weights, record.step_graph)
    return record


def step_graph_reason(trainer: Any, *, mode: str, kernels: bool, quantized: bool = False) -> str | None:
    """Why a trainer's token steps stay on CUDA graph trees rather than one recorded graph each
    (`vlmrl.engine.rollout.step_graph`), or None where they are recorded: compiled with `reduce-overhead` and
    vlmrl's kernels on, weights on a CUDA device and not sharded, over an unquantized base (measured in bf16) or a
    4-bit one whose token steps run vlmrl's nf4 kernel (`quantized`: the base is 4-bit), for models whose layers
    all attend to the whole cache. A 4-bit base left on bitsandbytes was not measured, so the graph trees stay
    there."""
    if mode != "reduce-overhead":
        return f"torch.compile mode {mode}"
    if not kernels:
        return "vlmrl's kernels are off"
    from vlmrl.engine.rollout import step_graph

    if (off_cuda := step_graph.cuda_reason(trainer.model)) is not None:
        return off_cuda
    if sharded(trainer):  # a replay would skip the hooks that gather and free the shards
        return "parameters are sharded by FSDP / DeepSpeed"
    if quantized and getattr(trainer, "vlmrl_nf4_decode", None) is None:
        return "a 4-bit base whose token steps stay on bitsandbytes (the recorded step was measured over the nf4 kernel)"
    config = getattr(trainer.model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        return f"the model has {', '.join(sorted(kinds - {'full_attention'}))} layers, whose cache a replay would not update"
    return None


def _rollout_adapters(trainer: Any, dtype: torch.dtype | None, *, kernels: bool,
                      first_factors: bool = False) -> tuple[Any, Any, str]:
    """How rollouts read the LoRA weights: the stacked projections (`stacked`; over a 4-bit base, with
    `first_factors`, the first factors stacked) where they apply, with `kernels` each group's second step one Triton
    kernel; else the bf16 adapter copies (`adapter_cast`) where they help. Returns the stack or None, the copies or
    None, and what the record says."""
    stack, stacked = _stacked(trainer, dtype, first_factors)
    if stack is None:
        copies, copied = _adapter_copies(trainer, dtype)
        return None, copies, f"{stacked}; {copied}"
    if not kernels:
        return stack, None, stacked
    if _base_dtype(trainer, dtype) != torch.bfloat16:
        return stack, None, stacked + SECOND_KERNEL_FALLBACK
    return stack, None, stacked + (BRANCH_KERNEL if stack.first_factors_only else SECOND_KERNEL)


def _stacked(trainer: Any, dtype: torch.dtype | None, first_factors: bool = False) -> tuple[Any, str]:
    """The stacked projections for rollouts (`stacked`) where possible, and what was done or why not."""
    refused = "not stacked ({})"
    if sharded(trainer):
        return None, refused.format("parameters are sharded by FSDP / DeepSpeed")
    base_dtypes = {p.dtype for p in trainer.model.parameters() if not p.requires_grad and p.is_floating_point()}
    adapter_dtypes = {p.dtype for p in trainer.model.parameters() if p.requires_grad}
    if dtype is None and adapter_dtypes - base_dtypes:  # float32 adapters, no rollout autocast to match them
        return None, refused.format("the adapters' dtype differs from the base's and rollouts run without autocast")
    from vlmrl.engine.rollout.stacked import StackedProjections

    stack = StackedProjections(trainer.model, dtype, first_factors=first_factors)
    if not stack.groups:
        return None, refused.format(stack.reason)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the base weights' old places
    sizes = sorted({len(g.layers) for g in stack.groups}, reverse=True)
    only = FIRST_FACTORS_ONLY if stack.first_factors_only else ""
    return stack, (f"stacked by shared input for rollouts ({len(stack.groups)} groups of {'/'.join(map(str, sizes))} "
                   f"projections{only}; first factors' rows {stack.nbytes / 2**30:.2f} GiB kept, second factors "
                   f"{stack.second_nbytes() / 2**30:.2f} GiB while it runs; the optimizer state waits on the host)")


def _adapter_copies(trainer: Any, dtype: torch.dtype | None) -> tuple[Any, str]:
    """The bf16 adapter copies for rollouts (`adapter_cast`) where useful, and what was done or why not."""
    if dtype is None:
        return None, "as stored (no float32 adapters over a low-precision base)"
    cast = f"float32, cast to {_dtype_name(dtype)} at each token step"
    if sharded(trainer):
        # accelerate shards (and replaces) the parameters after this point; copies of them would go stale
        return None, f"{cast} (no copies: parameters are sharded by FSDP / DeepSpeed)"
    from vlmrl.engine.rollout.adapter_cast import LowPrecisionAdapters

    copies = LowPrecisionAdapters(trainer.model, dtype)
    return copies, (f"{_dtype_name(dtype)} copies made per rollout ({copies.nbytes / 2**30:.2f} GiB while it runs; "
                    "the optimizer state waits on the host)")


def _cache_read(*, wanted: bool, attention: bool) -> tuple[bool, str]:
    """Whether token steps run the decode kernel, and which static-cache positions their attention reads."""
    from vlmrl.engine.rollout.decode_attention import HAS_TRITON

    whole = "the whole static cache"
    if not wanted:
        return False, whole
    if not attention:
        return False, f"{whole} (the decode kernel needs vlmrl_sdpa)"
    if not HAS_TRITON:
        return False, f"{whole} (the decode kernel needs Triton)"
    return True, whole + KERNEL_READ


def _base_dtype(trainer: Any, autocast: torch.dtype | None) -> torch.dtype | None:
    """The dtype rollouts compute the stacked projections in: the autocast's, else the frozen base's."""
    if autocast is not None:
        return autocast
    return next((p.dtype for p in trainer.model.parameters() if not p.requires_grad and p.is_floating_point()), None)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sharded(trainer: Any) -> bool:
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


def wrap_rollouts(trainer: Any, contexts: list[tuple[str, Callable[[], Any]]]) -> None:
    """Run each of TRL's rollout calls inside `contexts` ((name, factory) pairs, entered in order), kept on the
    trainer as `vlmrl_rollout_contexts`. Wrapping again replaces the earlier wrapper rather than nesting in it."""
    inner = trainer._generate_single_turn
    inner = getattr(inner, "_vlmrl_inner", inner)
    factories = [factory for _, factory in contexts]
    trainer.vlmrl_rollout_contexts = list(contexts)

    def generate(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for factory in factories:
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


def cache_key(model_kwargs: dict) -> str | None:
    """Where `generate` keeps its cache among the model's keyword arguments: `cache` in transformers after 5.17,
    `past_key_values` up to it."""
    return next((k for k in ("cache", "past_key_values") if k in model_kwargs), None)


def full_attention_static(cache: Any) -> bool:
    """A static cache of full-attention layers only (sliding-window layers keep their own length)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    return isinstance(cache, StaticCache) and all(type(layer) is StaticLayer for layer in cache.layers)


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
        key = cache_key(model_kwargs)
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
        full_attention_static(cache)
        and not getattr(cache, "offloading", False)  # the move below bypasses the offloading hooks
        and int(cache.get_seq_length()) == 0
    )


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


def compile_settings(mode: str = "reduce-overhead", all_devices: bool = False) -> dict:
    """`generate` kwargs for the same path outside the trainer (evaluation)."""
    return {"cache_implementation": "static", "compile_config": _compile_config(mode, all_devices)}


def _compile_config(mode: str, all_devices: bool) -> Any:
    from transformers import CompileConfig

    # dynamic=False: shapes are bucketed, and a static graph is what CUDA graphs (reduce-overhead) replay.
    compile_config = CompileConfig(fullgraph=False, dynamic=False, mode=mode)
    compile_config._compile_all_devices = all_devices or None  # a class-level switch; set only for CPU tests
    return compile_config
