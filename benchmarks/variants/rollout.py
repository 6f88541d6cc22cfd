"""Rollout variants (unsupported; see the package's docstring), and `apply`, which adds them to a trainer that
`vlmrl.engine.rollout.fast.enable_fast_generation` set up, from outside: through the trainer's rollout contexts
(`trainer.vlmrl_rollout_contexts`, wrapped again with `wrap_rollouts`) and the product's public pieces.

- `attend_filled(model, window)`: each token step's attention reads only the filled static-cache positions,
  rounded up to `window`, instead of the whole cache (`vlmrl_sdpa` wrapped by `filled_sdpa`, which reads `FILLED`).
  The same attention up to float summation order; CUDA graphs record one graph per window.
- `guards_once(model)`: each `generate` call's compiled token steps check dynamo's guards until one compiles
  nothing, and skip them after (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`).
- `unstacked()`: inside it, `enable_fast_generation` finds nothing to stack (`StackedProjections` replaced by a
  subclass that stacks nothing), so it makes the bf16 adapter copies, as where stacking does not apply.
- `apply(trainer, fast, ...)`: those, the adapter merge (`merge.rollout_merge`), one of vlmrl's two token-step
  kernels off, a 4-bit base's token steps on bitsandbytes, through the nf4 kernel's first design (`nf4_v1`) or the
  product's with the LoRA branch folded in or only its sum in its last pass (`nf4_lora`), added to the trainer's
  rollouts; returns the record as a `VariantRecord` (the product's `FastGeneration` with `merge` and `guards`).
- `input_cast(trainer, loss_pass)`: PEFT's float32 casts of the LoRA inputs back in the loss pass.
What each was worth: benchmarks/NOTES.md ("The engine's pieces, one by one").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vlmrl.engine.patch import replaced
from vlmrl.engine.rollout import stacked
from vlmrl.engine.rollout.fast import (
    BRANCH_KERNEL,
    FINISHED_READ,
    FIRST_FACTORS_ONLY,
    GRAPH_TREES_BRANCH,
    KERNEL_READ,
    SECOND_KERNEL,
    FastGeneration,
    cache_key,
    full_attention_static,
    wrap_rollouts,
)

log = logging.getLogger(__name__)
# Contexts that serve the unmerged adapter; a merged rollout has no use for them.
_UNMERGED = ("offload", "adapter_copies", "stacked")


@dataclasses.dataclass(frozen=True)
class VariantRecord(FastGeneration):
    """The product's record of a fast rollout, with what the variants add: `merge` (the adapter merged for rollouts,
    or why not) and `guards` ("first step": dynamo's guards checked until steady)."""

    merge: str | None = None
    guards: str | None = None

    def as_dict(self) -> dict:
        return {**super().as_dict(), "merge": self.merge, "guards": self.guards}


class _Unstacked(stacked.StackedProjections):
    """`StackedProjections` that stacks nothing: the product then makes its bf16 adapter copies instead."""

    def __init__(self, model: Any, dtype: Any = None, **_: Any):
        self.groups = []
        self.reason = "turned off by a bench variant"


@contextlib.contextmanager
def unstacked() -> Iterator[None]:
    """Inside the block, `enable_fast_generation` stacks no projections (it finds none to stack) and falls back to
    the adapter copies, as where stacking does not apply."""
    with replaced(stacked, "StackedProjections", _Unstacked):
        yield


def input_cast(trainer: Any, loss_pass: Any) -> Any:
    """PEFT's float32 casts of the LoRA layers' inputs back in `trainer`'s loss pass (after `enable_loss_pass`,
    which had them skipped under autocast); returns the loss pass's record saying so."""
    from vlmrl.engine.lora_layers import lora_layers

    for layer in lora_layers(trainer.model):
        layer.cast_input_dtype_enabled = True  # PEFT's own setting
    return dataclasses.replace(loss_pass, adapter_inputs="cast to float32 by PEFT (a bench variant)")


def apply(trainer: Any, fast: FastGeneration, *, merge: bool = False, filled_window: int = 0,
          guards_once: bool = False, sdpa_decode: bool = False, second_cublas: bool = False,
          nf4_kernel: str = "", finished_read: bool = False, second_inline: bool = False,
          inductor: dict | None = None, graph_trees: bool = False, branch_apart: bool = False,
          group_apart: bool = False) -> FastGeneration:
    """Add the variants to `trainer`'s rollouts (set up by `enable_fast_generation`, which returned
    `fast`) and return `fast` with what was done. `merge`: the adapter merged for each rollout; `filled_window` > 0:
    attention over the filled cache positions in windows of that many; `guards_once`: dynamo's guards checked until
    the token steps are steady; `sdpa_decode`: token steps attend through SDPA instead of vlmrl's decode kernel;
    `second_cublas`: the stacked projections' second step as a cuBLAS matmul and a sum instead of one kernel;
    `nf4_kernel`: "off", a 4-bit base's token steps on bitsandbytes instead of the product's nf4 kernel; "v1",
    through the kernel's first design (`nf4_v1`, on for the trainer's life, as the product's is); "folded", the
    product's kernel with the LoRA branch's second factor and sum folded into its last pass (`nf4_lora`); "summed",
    the same with the branch's factors as PEFT runs them and only its scale and sum in that pass; "by_rule", the
    product's kernel with `nf4_settings.rule_config`'s settings everywhere (no `TUNED_SM90`); "loads", with its table lookups
    as loads and its K splits summed by a second kernel; "split_sum", the splits alone so summed; "bytes", its packed
    bytes decoded a byte at a time as before it read words (`nf4_bytes`), its splits summed so; `finished_read`:
    rows that have ended keep reading their whole cache at token steps (the product narrows their mask, `finished`);
    `second_inline`: the stacked groups' second step as pointwise products inductor may fold into the kernels around
    it (`second_inline`), instead of one kernel a group; `inductor`: inductor settings patched while rollouts run
    (their compile included), e.g. {"combo_kernels": True}; `graph_trees`: token steps launched by torch.compile's
    CUDA graph trees (reduce-overhead), as before the product recorded each rollout's step as one graph, and over a
    4-bit base PEFT's own LoRA branch, as then (what the product falls back to); `branch_apart`: over a 4-bit base
    whose first factors are stacked, each projection's LoRA branch apart from its nf4 kernel (the group's first-factor
    matmul, the member's second-step kernel), as before `nf4_branch`; `group_apart`: each stacked group's token step as
    cuBLAS's matmul, then the second-step kernel, as before `group_step`. Call it right
    after `enable_fast_generation`, before anything else wraps the trainer's rollout call. Returns a `VariantRecord`
    (`fast` itself when fast generation is off)."""
    if not fast.enabled:
        return fast
    contexts = list(trainer.vlmrl_rollout_contexts)
    names = [name for name, _ in contexts]
    changes: dict[str, Any] = {}
    if merge:
        from .merge import rollout_merge

        merger, changes["merge"] = rollout_merge(trainer)
        if merger is not None:
            if any(name in _UNMERGED for name in names):
                changes["adapters"] = "merged into the base weights (stacked projections and copies unused)"
            contexts = [(name, factory) for name, factory in contexts if name not in _UNMERGED]
            _insert(contexts, ("merge", merger.merged), before=("autocast", "stop_check"))
    if filled_window > 0:
        read = fast.cache_read or ""
        if "attention" in names:
            contexts.insert(names.index("attention") + 1,
                            ("filled_window", lambda: attend_filled(trainer.model, filled_window)))
            changes["cache_read"] = read.replace("the whole static cache",
                                                 f"filled positions, rounded up to {filled_window}", 1)
        else:
            changes["cache_read"] = f"{read} (the filled window needs vlmrl_sdpa)"
    if sdpa_decode:
        contexts = [(name, factory) for name, factory in contexts if name not in ("decode_kernel", "finished_rows")]
        changes["cache_read"] = changes.get("cache_read", fast.cache_read or "").replace(KERNEL_READ, "")
    elif finished_read:
        contexts = [(name, factory) for name, factory in contexts if name != "finished_rows"]
        changes["cache_read"] = changes.get("cache_read", fast.cache_read or "").replace(
            FINISHED_READ, ", rows that have ended reading all of theirs (a bench variant)")
    if second_cublas:
        contexts = _stacked_with(contexts, fused=False)
        changes["adapters"] = changes.get("adapters", fast.adapters or "").replace(SECOND_KERNEL, "")
    if second_inline:
        from .second_inline import second_inline as inline

        contexts.append(("second_inline", inline))
        changes["adapters"] = changes.get("adapters", fast.adapters or "").replace(
            SECOND_KERNEL, "; token steps: each group's second step as pointwise products (a bench variant)")
    if branch_apart:
        _insert(contexts, ("branch_apart", _branch_apart), before=("stacked",))
        changes["adapters"] = changes.get("adapters", fast.adapters or "").replace(
            BRANCH_KERNEL, SECOND_KERNEL + ", apart from each projection's nf4 kernel (a bench variant)")
    if group_apart:
        contexts.append(("group_apart", _group_apart))
        changes["adapters"] = changes.get("adapters", fast.adapters or "").replace(
            SECOND_KERNEL, "; token steps: each group's matmul on cuBLAS, its second step one Triton kernel (a bench "
                           "variant)")
    if inductor:
        import torch._inductor.config

        contexts.append(("inductor", functools.partial(torch._inductor.config.patch, **inductor)))
        changes["mode"] = f"{fast.mode}, inductor {inductor} (a bench variant)"
    if guards_once:
        _insert(contexts, ("guards_once", lambda: _guards_once(trainer.model)), before=("compile_over_4bit",))
        changes["guards"] = "first step"
    if graph_trees and "step_graph" in names:
        # as the product falls back: the graph trees, and over a 4-bit base PEFT's branch, not the first factors
        contexts = _stacked_with([c for c in contexts if c[0] != "step_graph"], first_factors=lambda: False)
        trainer.generation_config.compile_config.mode = "reduce-overhead"
        changes["mode"] = "reduce-overhead"
        changes["step_graph"], changes["graphs"] = "CUDA graph trees (a bench variant)", None
        if FIRST_FACTORS_ONLY in (fast.adapters or ""):
            changes["adapters"] = fast.adapters + GRAPH_TREES_BRANCH
    if nf4_kernel and fast.weights is not None:  # (None: not a 4-bit base)
        changes["weights"] = _nf4_for_life(trainer, nf4_kernel)
    wrap_rollouts(trainer, contexts)
    log.warning("rollout variants (benchmarks/variants): %s", changes or "none")
    record = {field.name: getattr(fast, field.name) for field in dataclasses.fields(fast)}
    return VariantRecord(**(record | changes))


@contextlib.contextmanager
def _branch_apart() -> Iterator[None]:
    """Inside the block no 4-bit group's members are taken by `nf4_branch`: its first-factor matmul, each member's
    nf4 kernel and second-step kernel, as the product ran them before."""
    from vlmrl.engine.rollout import nf4_branch

    with replaced(nf4_branch, "takes", lambda layer, dtype: False):
        yield


@contextlib.contextmanager
def _group_apart() -> Iterator[None]:
    """Inside the block no stacked group runs `group_step`'s kernel: cuBLAS's matmul, then the second-step kernel."""
    from vlmrl.engine.rollout import group_step

    with replaced(group_step, "usable", lambda *args: False):
        yield


def _stacked_with(contexts: list, **keywords: Any) -> list:
    """`contexts` with the product's "stacked" context (a partial of `StackedProjections.active`) given `keywords`."""
    return [(name, functools.partial(factory.func, **{**factory.keywords, **keywords}) if name == "stacked" else factory)
            for name, factory in contexts]


def _nf4_for_life(trainer: Any, kernel: str) -> str:
    """Undo the product's nf4 routing (`vlmrl.engine.rollout.quantized_base.nf4_token_steps`) and, for "v1", route the
    trainer's 4-bit token steps through the first design until the trainer goes; what the record says."""
    from vlmrl.engine.rollout.quantized_base import BITSANDBYTES

    product = getattr(trainer, "vlmrl_nf4_decode", None)
    if product is not None:
        product.close()
        trainer.vlmrl_nf4_decode = None
    if kernel == "off":
        return f"{BITSANDBYTES} (vlmrl's nf4 kernel turned off by a bench variant)"
    if kernel in ("folded", "summed"):
        from vlmrl.engine.rollout.nf4 import MAX_ROWS, MIN_ROWS, nf4_decode

        from . import nf4_lora

        summed = kernel == "summed"
        stack = contextlib.ExitStack()
        reason = stack.enter_context(nf4_decode(trainer.model))
        trainer.vlmrl_nf4_decode = stack
        if reason is not None:
            return f"{BITSANDBYTES} (nf4 kernel with the LoRA branch {kernel} asked for, not used: {reason})"
        why_not = (nf4_lora.probe(trainer.model, summed=summed) if nf4_lora.adapted_layers(trainer.model)
                   else "no LoRA layer")
        if why_not is not None:
            return (f"vlmrl nf4 kernel for token steps of {MIN_ROWS}-{MAX_ROWS} rows, the LoRA branch in PEFT's "
                    f"forward ({'its sum in the kernel' if summed else 'folding it'} asked for, not done: "
                    f"{why_not}), {BITSANDBYTES} otherwise")
        folded, adapted = stack.enter_context(nf4_lora.nf4_lora_decode(trainer.model, summed=summed))
        moved = "scale and sum" if summed else "second factor and sum"
        return (f"vlmrl nf4 kernel for token steps of {MIN_ROWS}-{MAX_ROWS} rows, the LoRA branch's {moved} "
                f"in its last pass for {folded} of {adapted} adapted layers (variants.nf4_lora), "
                f"{BITSANDBYTES} otherwise")
    from vlmrl.engine.rollout.nf4 import MAX_ROWS, MIN_ROWS

    from .nf4_v1 import nf4_decode_with, nf4_matmul_v1

    designs = {"v1": ("v1", nf4_matmul_v1),
               "by_rule": ("with its settings by rule, not TUNED_SM90", _nf4_matmul_by_rule),
               "loads": ("with its table lookups as loads, not warp shuffles", _nf4_matmul_loads),
               "split_sum": ("with its K splits summed by a second kernel", _nf4_matmul_split_sum),
               "bytes": (("decoding a byte at a time, as before it read words, its K splits summed by a second "
                          "kernel"), _nf4_matmul_bytes)}
    design, matmul = designs[kernel]
    stack = contextlib.ExitStack()
    reason = stack.enter_context(nf4_decode_with(trainer.model, matmul))
    trainer.vlmrl_nf4_decode = stack  # held (and closed) with the trainer
    if reason is not None:
        return f"{BITSANDBYTES} (nf4 kernel {design} asked for, not used: {reason})"
    return (f"vlmrl nf4 kernel {design} (a bench variant) for token steps of {MIN_ROWS}-{MAX_ROWS} rows, "
            f"{BITSANDBYTES} otherwise")


def _nf4_matmul_by_rule(x: Any, weight: Any, bias: Any = None, *, quant_state: Any = None) -> Any:
    """The product's nf4 matmul with `nf4_settings.rule_config`'s settings for every shape (its `TUNED_SM90` table left
    out): the A/B partner that table was measured against end to end."""
    from vlmrl.engine.rollout import nf4, nf4_settings

    qs = quant_state if quant_state is not None else weight.quant_state
    n, k = qs.shape
    config = nf4_settings.rule_config(x.numel() // k, n, k, qs.blocksize, x.device)
    return nf4.nf4_matmul(x, weight, bias, quant_state=qs, config=config)


def _nf4_matmul_loads(x: Any, weight: Any, bias: Any = None, *, quant_state: Any = None) -> Any:
    """The product's nf4 matmul, settings included, with its table lookups as loads (`nf4_loads`)."""
    from .nf4_loads import nf4_matmul_loads

    return nf4_matmul_loads(x, weight, bias, quant_state=quant_state)


def _nf4_matmul_split_sum(x: Any, weight: Any, bias: Any = None, *, quant_state: Any = None) -> Any:
    """The product's nf4 matmul, settings and warp-shuffle lookups included, with a split K summed by a second
    kernel, as before the tile kernel's last split summed them (`nf4_loads`)."""
    from .nf4_loads import nf4_matmul_shuffle

    return nf4_matmul_shuffle(x, weight, bias, quant_state=quant_state)


def _nf4_matmul_bytes(x: Any, weight: Any, bias: Any = None, *, quant_state: Any = None) -> Any:
    """The product's nf4 matmul, settings included, with its packed bytes decoded a byte at a time, as before it read
    words (`nf4_bytes`), and a split K summed by a second kernel."""
    from .nf4_bytes import nf4_matmul_bytes

    return nf4_matmul_bytes(x, weight, bias, quant_state=quant_state)


def _insert(contexts: list[tuple[str, Callable[[], Any]]], entry: tuple[str, Callable[[], Any]], *,
            before: tuple[str, ...]) -> None:
    """Insert `entry` before the first context named in `before` that is there; at the end when none is."""
    names = [name for name, _ in contexts]
    at = next((names.index(name) for name in before if name in names), len(contexts))
    contexts.insert(at, entry)


@contextlib.contextmanager
def attend_filled(model: Any, window: int) -> Iterator[None]:
    """Inside the block, each token step on a static cache tells `vlmrl_sdpa` how many leading cache positions
    can be attended to: the tokens so far (the step's own included), rounded up to `window`, at most the cache.

    Wraps the model's `prepare_inputs_for_generation`, which `generate` calls on the host before every step with
    all tokens so far, so the length is known without reading the device. It travels as the size of a view of one
    buffer (`FILLED`), marked dynamic: a compiled decode step takes it as a symbolic size rather than recompiling
    for each value, and CUDA graphs record one graph per window (cache length / window of them at most). While
    active, `vlmrl_sdpa`'s registered function is `filled_sdpa`, which reads it.
    """
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from vlmrl.engine.rollout import attention
    from vlmrl.engine.rollout.attention import base_model

    attention.register()
    base = base_model(model)
    original = base.prepare_inputs_for_generation
    buffers: dict[tuple[torch.device, int], torch.Tensor] = {}

    def prepare(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        inputs = original(input_ids, *args, **kwargs)
        key = cache_key(inputs)
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

    sdpa = ALL_ATTENTION_FUNCTIONS[attention.NAME]
    AttentionInterface.register(attention.NAME, functools.partial(filled_sdpa, sdpa))
    try:
        with replaced(base, "prepare_inputs_for_generation", prepare):
            yield
    finally:
        AttentionInterface.register(attention.NAME, sdpa)


FILLED = "vlmrl_filled"  # the keyword argument carrying the attendable cache length (as a tensor's size)


def filled_sdpa(sdpa: Callable[..., Any], module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
    """`sdpa` (vlmrl_sdpa's function) on the first `len(kwargs[FILLED])` cache positions only, when given."""
    key, value, attention_mask = attend_filled_only(key, value, attention_mask, kwargs.pop(FILLED, None))
    return sdpa(module, query, key, value, attention_mask, *args, **kwargs)


def attend_filled_only(
    key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, filled: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The first `len(filled)` cache positions of `key`, `value` and a mask over the same positions; unchanged
    without `filled`, or without a mask over the whole cache (nothing would hide the unwritten positions)."""
    if filled is None or mask is None or mask.shape[-1] != key.shape[-2]:
        return key, value, mask
    length = filled.shape[0]
    return key[:, :, :length], value[:, :, :length], mask[..., :length]


def _static_cache_length(cache: Any) -> int | None:
    """The length of a static cache of full-attention layers only; None for any other cache."""
    if not full_attention_static(cache) or not cache.layers:
        return None
    lengths = {layer.max_cache_len for layer in cache.layers}
    return lengths.pop() if len(lengths) == 1 else None


@contextlib.contextmanager
def guards_once(model: Any) -> Iterator[None]:
    """Inside the block, the compiled token steps of each `generate` call check dynamo's guards until one of them
    compiles nothing; the later steps of the call run under `torch.compiler.set_stance(skip_guard_eval_unsafe=True)`.

    Dynamo checks thousands of guards on the model's attributes and inputs before every call of a compiled
    function, on the host. Within one `generate` call nothing they check changes from one token step to the next
    once the steps are steady: the static cache, the batch and every shape are fixed for the call. The first steps
    check everything (and compile when something did change, e.g. a new cache length), so only steady repeats are
    skipped; torch still checks the guards that tell its compiled entries apart. Should a skipped step still need
    a graph that is not compiled (torch raises instead of compiling under that stance), the step runs again with
    its guards checked, and so does the rest of the call: a token step is a pure function of its inputs and the
    cache positions it writes, so running it again writes the same values. Wraps the model's `get_compiled_call`
    (transformers 5.x), which `generate` calls once per call.
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

    with replaced(base, "get_compiled_call", get_compiled_call):
        yield


_guards_once = guards_once  # `apply`'s keyword of the same name hides the function inside it
