"""A token step over bitsandbytes nf4 weights: a Triton kernel that reads the packed 4-bit weights once.

At a decode step `Linear4bit` multiplies a few dozen rows by weights bitsandbytes stores as nf4 codes, and its
kernels take many times the weight-read floor (benchmarks/NOTES.md, "The nf4 token-step kernel"). Here each program
streams 2-D tiles of packed bytes as int32 words (the next step's in flight while one is decoded), looks each code up
in the 16-value table straight from the shifted word (compiled, by warp shuffles, checked against table loads once
per setting: `shuffles_hold`), scales it by its block's absmax (decoded from its 8-bit code when double-quantised),
rounds it as `dequantize_4bit` rounds, joins each word's eight weights back into the row's order and multiplies them
by x's columns, read along k in 16-byte loads, on the tensor cores, accumulating in fp32; few output columns split
K, and the last split of a tile to finish sums the splits' shares in their order (a counter per tile; a second
kernel where no counters can be had). The result is `dequantize_4bit` then `x @ W.T` (+ bias) up to summation
order: each weight bit-equal, each output within one bf16/fp16 unit in the last place (tests/test_nf4.py says how
outputs near zero are counted). Its Triton source is `nf4_triton`; the first design, which lost to this one, is a
benchmark plugin (benchmarks/variants/nf4_v1.py), as is the byte-at-a-time loop before the words (nf4_bytes).

Public: `nf4_matmul`; `launch` (a split K summed in the tile kernel, its arrivals counted by
`arrivals.split_counters`) and `sum_splits` (the second kernel's in-order sum), which it runs; `nf4_decode(model)`,
which routes `Linear4bit` forwards of `MIN_ROWS` to `MAX_ROWS` rows without gradients through the kernel while
active (one-row steps, where bitsandbytes runs its gemv, prompt passes, training and unsupported layers stay on
bitsandbytes, the fallback); `unsupported_reason(model)`, for the caller to record why a model stays there;
`gpu_reason(device)`, the product's rule for where the kernel is on; `probe(model)`, a launch on the model's first
routed layer, and `failure(x)`, why the kernel fell back; `shuffles_hold`, the check that decides each setting's
lookups, and `lookups()`, what it decided; `quant_state(layer)`; `reference`, its fallback's arithmetic;
`is_linear4bit` and `layer_reason(layer)`, which layers it takes; `forwards_replaced`, its patching of forwards;
`measured_settings(model)`, how many routed layers take the settings measured on sm_90 (the tile settings are
`nf4_settings`'s).
`vlmrl.engine.rollout.fast` turns it on for a 4-bit base's rollouts. Limits: nf4 (not fp4), blocksizes 32-256
dividing in_features, packed weights on a 4-byte boundary (`WORD`), bf16/fp16 activations, CUDA (Triton's
interpreter on a CPU, for tests); on by default only on the GPUs where it was measured faster than bitsandbytes
(`gpu_reason`). No maintained library fits (package index, 2026-12): FLUTE ships a C++ extension built for torch 2.5
/ CUDA 12.1 over its own repacked layout, and gemlite's kernels take affine (scale, zero) codes, not a 16-value
table.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from vlmrl.engine.rollout import nf4_settings, nf4_triton
from vlmrl.engine.rollout.arrivals import split_counters
from vlmrl.engine.rollout.decode_attention import HAS_TRITON, interpreted, kernel_or_fallback

log = logging.getLogger(__name__)
_failed: dict[tuple, str] = {}  # (device, dtype) -> why the kernel could not run there
_shuffles: dict[tuple, bool] = {}  # a launch's device, dtype, shape and settings -> its shuffles read the table

MAX_ROWS = 64  # rows of a token step (the rollout batch); a prompt pass's many rows stay on bitsandbytes
MIN_ROWS = 2  # one row: bitsandbytes' own gemv is faster (benchmarks/NOTES.md, "The nf4 token-step kernel")
BLOCKSIZES = (32, 64, 128, 256)
WORD = 4  # bytes the kernel reads packed weights in: their address must be a multiple of it
DTYPES = (torch.bfloat16, torch.float16)
_ROUNDING = {torch.bfloat16: 1, torch.float16: 2}  # the dequantized weight's dtype -> the kernel's code (0: fp32)


def nf4_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               quant_state: Any = None, config: list[int] | None = None) -> torch.Tensor:
    """`x @ W.T (+ bias)` in x's dtype (bf16/fp16), fp32 accumulation, for W the nf4 weight `weight` (a bitsandbytes
    `Params4bit`, or its packed bytes with their `quant_state`): bitsandbytes' `dequantize_4bit(weight).to(x.dtype)`
    then `F.linear`, up to summation order. `config` = [block_n, block_kh (packed bytes), warps, stages, split]
    (benchmarks); left out, it is chosen by shape."""
    return call(_nf4_matmul, x, weight, bias, quant_state, config)


def call(op: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         quant_state: Any, config: list[int] | None) -> torch.Tensor:
    """Unpack `weight`'s quant state and call `op`, a custom op over (x, packed, absmax, code2, absmax2, offset,
    lut, bias, blocksize, blocksize2, rounding, config)."""
    qs = quant_state if quant_state is not None else weight.quant_state
    n, k = qs.shape
    packed = weight.data.view(torch.uint8).reshape(n, k // 2)
    if qs.nested:
        offset = qs.offset if isinstance(qs.offset, torch.Tensor) else torch.tensor(float(qs.offset))
        nested = (qs.state2.code, qs.state2.absmax, offset.to(packed.device, torch.float32), qs.state2.blocksize)
    else:
        nested = (None, None, None, 1)
    code2, absmax2, offset, blocksize2 = nested
    if bias is not None:
        bias = bias.to(x.dtype)
    out = op(x.reshape(-1, k), packed, qs.absmax, code2, absmax2, offset, qs.code, bias, qs.blocksize, blocksize2,
             _ROUNDING.get(qs.dtype, 0), list(config or []))
    return out.view(*x.shape[:-1], n)


NO_4BIT = "the model has no bitsandbytes Linear4bit layer"


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `nf4_decode(model)` would leave every token step on bitsandbytes, or None when it routes some layer
    (each layer it cannot take stays on bitsandbytes: a vision tower's odd widths, say)."""
    if not HAS_TRITON:
        return "Triton is not installed"
    layers = _linear4bit_layers(model)
    if not layers:
        return NO_4BIT
    reasons = [reason for layer in layers if (reason := layer_reason(layer)) is not None]
    if len(reasons) < len(layers):
        return None
    reason, count = collections.Counter(reasons).most_common(1)[0]
    return f"no Linear4bit layer fits the nf4 kernel ({count} of {len(layers)}: {reason})"


def gpu_reason(device: torch.device) -> str | None:
    """Why the product leaves a 4-bit base's token steps on bitsandbytes on `device`, or None where it routes them
    through the kernel: the GPUs where it was measured faster than bitsandbytes' `Linear4bit` end to end (an H200,
    sm_90: benchmarks/NOTES.md). Elsewhere nobody has measured which is faster, so bitsandbytes stays."""
    if device.type != "cuda":
        return f"weights on {device}, not a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    measured = nf4_settings.MEASURED_MAJOR
    if major != measured:
        return f"measured faster than bitsandbytes on sm_{measured}0 (H100/H200) only; this GPU is sm_{major}{minor}"
    return None


def probe(model: torch.nn.Module) -> str | None:
    """Launch the kernel once on the first layer `nf4_decode` would route, at `MIN_ROWS` zero rows; why it cannot
    run there (a Triton build or launch error), or None. A failure is also recorded, so the routed layers would
    fall back to dequantize + matmul, which is slower than bitsandbytes' own forward: don't route then."""
    layer = next((m for m in _linear4bit_layers(model) if layer_reason(m) is None), None)
    if layer is None:
        return unsupported_reason(model)
    dtype = layer.compute_dtype if layer.compute_dtype in DTYPES else torch.bfloat16
    x = torch.zeros(MIN_ROWS, layer.in_features, device=layer.weight.device, dtype=dtype)
    with torch.no_grad():
        nf4_matmul(x, layer.weight, quant_state=layer.weight.quant_state)
    return failure(x)


def failure(x: torch.Tensor) -> str | None:
    """Why the kernel fell back to torch on x's device and dtype; None where it has not."""
    return _failed.get(_where(x))


@contextlib.contextmanager
def nf4_decode(model: torch.nn.Module, max_rows: int = MAX_ROWS, min_rows: int = MIN_ROWS) -> Iterator[str | None]:
    """While active, forwards of the model's `Linear4bit` layers with `min_rows` to `max_rows` rows and no gradient
    run `nf4_matmul`; the rest (one-row steps, prompt passes, the loss pass) run bitsandbytes' own forward. Yields
    `unsupported_reason(model)`: None when some layer is routed, else why none is (then nothing changes)."""
    reason = unsupported_reason(model)
    layers = _linear4bit_layers(model)
    routed = _routable(layers) if reason is None else []
    with forwards_replaced(routed, lambda layer, forward: _routed(layer, forward, min_rows, max_rows)):
        if reason is None:
            log.info("nf4 token-step kernel on for %d of %d Linear4bit layers", len(routed), len(layers))
        yield reason


@contextlib.contextmanager
def forwards_replaced(layers: list[torch.nn.Module],
                      wrap: Callable[[torch.nn.Module, Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """While active, each of `layers` runs `wrap(layer, its forward)` as its forward; after, its own again (an
    instance's own forward, an accelerate hook's say, kept), also when the block raises."""
    before = [(layer, layer.__dict__.get("forward")) for layer in layers]
    try:
        for layer in layers:
            layer.forward = wrap(layer, layer.forward)
        yield
    finally:
        for layer, forward in before:
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = forward


def dequantize(packed: torch.Tensor, absmax: torch.Tensor, code2: torch.Tensor | None, absmax2: torch.Tensor | None,
               offset: torch.Tensor | None, lut: torch.Tensor, blocksize: int, blocksize2: int) -> torch.Tensor:
    """bitsandbytes' `dequantize_4bit` in torch, in float32 ([N, K] from packed [N, K/2]): the kernel's fallback."""
    n = packed.shape[0]
    codes = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(n, -1).long()
    if code2 is not None:  # double quantisation: 8-bit codes of (absmax - offset) in blocks of blocksize2
        scale = code2[absmax.long()] * absmax2.repeat_interleave(blocksize2)[:absmax.numel()]
        scale = scale + offset  # rounded apart from the product, as bitsandbytes does
    else:
        scale = absmax.float()
    return (lut[codes].view(-1, blocksize) * scale.view(-1, 1)).view(n, -1)


def is_linear4bit(module: torch.nn.Module) -> bool:
    """Whether `module` is a bitsandbytes `Linear4bit` (imported only by a model that has such layers)."""
    cls = getattr(sys.modules.get("bitsandbytes.nn"), "Linear4bit", None)
    return cls is not None and isinstance(module, cls)


def _linear4bit_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if is_linear4bit(m)]


def _routable(layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The layers the kernel can take (`layer_reason` None)."""
    return [layer for layer in layers if layer_reason(layer) is None]


def quant_state(layer: torch.nn.Module) -> Any:
    """A `Linear4bit` layer's quant state, where bitsandbytes finds it (on its weight, else on the layer); None before
    quantization."""
    return getattr(layer.weight, "quant_state", None) or getattr(layer, "quant_state", None)


def layer_reason(layer: torch.nn.Module) -> str | None:
    """Why the kernel cannot take `Linear4bit` layer `layer` (its quant state, shape, device or dtype); None when
    it can."""
    weight = layer.weight
    qs = quant_state(layer)
    if qs is None:
        return "weights not quantized yet"
    if qs.quant_type != "nf4":
        return f"quant_type {qs.quant_type} (the kernel reads nf4)"
    if qs.blocksize not in BLOCKSIZES:
        return f"blocksize {qs.blocksize} (the kernel takes {', '.join(map(str, BLOCKSIZES))})"
    if len(qs.shape) != 2 or qs.shape[1] % qs.blocksize:
        return f"weight shape {tuple(qs.shape)} (in_features must be a multiple of the blocksize)"
    if getattr(qs, "packing_format_for_cpu", False):
        return "weights repacked for bitsandbytes' CPU kernel"
    if not (weight.is_cuda or interpreted()):
        return f"weights on {weight.device}, not a CUDA device"
    if not weight.data.is_contiguous() or weight.data.numel() * weight.data.element_size() * 2 != qs.shape.numel():
        return "packed weights not contiguous bytes"
    if weight.data.data_ptr() % WORD:
        return f"packed weights not {WORD}-byte aligned (the kernel reads them as 32-bit words)"
    if getattr(layer, "compute_dtype", None) not in (None, *DTYPES):
        return f"compute dtype {layer.compute_dtype} (the kernel computes in bf16/fp16)"
    return None


def _routed(layer: torch.nn.Module, fallback: Callable[..., torch.Tensor], min_rows: int,
            max_rows: int) -> Callable[..., Any]:
    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        dtype = layer.compute_dtype if layer.compute_dtype is not None else x.dtype  # as bitsandbytes computes
        bias = layer.bias
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (args or kwargs or not min_rows <= rows <= max_rows or dtype not in DTYPES or x.device != layer.weight.device
                or (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)))):
            return fallback(x, *args, **kwargs)
        qs = quant_state(layer)
        return nf4_matmul(x.to(dtype), layer.weight, bias, quant_state=qs).to(x.dtype)

    return forward


@torch.library.custom_op("vlmrl::nf4_matmul", mutates_args=())
def _nf4_matmul(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code2: torch.Tensor | None,
                absmax2: torch.Tensor | None, offset: torch.Tensor | None, lut: torch.Tensor, bias: torch.Tensor | None,
                blocksize: int, blocksize2: int, rounding: int, config: list[int]) -> torch.Tensor:
    args = (x, packed, absmax, code2, absmax2, offset, lut, bias, blocksize, blocksize2, rounding, config)
    if packed.data_ptr() % WORD:  # this tensor's layout, not the device: nothing to record
        return reference(*args)
    return kernel_or_fallback(_failed, _where(x), lambda: launch(*args), lambda: reference(*args),
                              what="nf4 matmul kernel", instead="dequantize + matmul", logger=log)


def _where(x: torch.Tensor) -> tuple:
    """The key under which the kernel's fallback on x's device and dtype is recorded in `_failed`."""
    return (str(x.device), x.dtype)


@_nf4_matmul.register_fake
def output_like(x: torch.Tensor, packed: torch.Tensor, *args: Any) -> torch.Tensor:
    """The op's output for tracing (a custom op's fake): [rows, out_features] in x's dtype."""
    return x.new_empty((x.shape[0], packed.shape[0]))


def reference(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code2: torch.Tensor | None,
              absmax2: torch.Tensor | None, offset: torch.Tensor | None, lut: torch.Tensor, bias: torch.Tensor | None,
              blocksize: int, blocksize2: int, rounding: int, config: list[int]) -> torch.Tensor:
    weight = dequantize(packed, absmax, code2, absmax2, offset, lut, blocksize, blocksize2)
    if rounding:  # bitsandbytes dequantizes to the weight's dtype, then casts to the activations'
        weight = weight.to(torch.bfloat16 if rounding == 1 else torch.float16)
    return F.linear(x, weight.to(x.dtype), bias)


def measured_settings(model: torch.nn.Module) -> str:
    """What the record says of the settings the routed layers of `model` take on sm_90: how many have their shape in
    `nf4_settings.TUNED_SM90` (at 2-32 rows), the rest by rule."""
    routed = _routable(_linear4bit_layers(model))
    tuned = sum(all((*qs.shape, qs.blocksize, rows) in nf4_settings.TUNED_SM90 for rows in (16, 32))
                for qs in map(quant_state, routed))
    return (f"tile settings measured on an H200 for {tuned} of {len(routed)} layers at 2-32 rows "
            "(nf4_settings.TUNED_SM90), by rule otherwise")


def launch(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code2: torch.Tensor | None,
           absmax2: torch.Tensor | None, offset: torch.Tensor | None, lut: torch.Tensor, bias: torch.Tensor | None,
           blocksize: int, blocksize2: int, rounding: int, config: list[int],
           lora: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor | None:
    """Launch the tile kernel on x [rows, k], with `config` or else `nf4_settings.config`'s settings; a split K is
    summed by its last split to finish (`split_counters`), or by `sum_splits` where no counters can be had.
    `lora` = (first [rank, k], second [n, rank], scale), bf16 only: the output is the base's plus the LoRA branch,
    as `nf4_branch` says (None where K is split and no counters can be had: the caller computes it apart)."""
    rows, k = x.shape
    n = packed.shape[0]
    if rows == 0:
        return x.new_empty((0, n))
    if x.dtype not in DTYPES:
        raise TypeError(f"activations in {x.dtype}: the kernel takes bf16/fp16")
    if packed.data_ptr() % WORD:
        raise ValueError(f"packed weights at an address not a multiple of {WORD}: the kernel reads 32-bit words")
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_n, tile, warps, stages, split = config or nf4_settings.config(rows, n, k, blocksize, x.device)
    half = blocksize // 2
    if tile % half:
        raise ValueError(f"tile of {tile} packed bytes is not a whole number of {blocksize}-weight blocks")
    steps = -(-k // (2 * tile))
    per_split = -(-steps // max(1, min(split, steps))) * tile  # packed bytes per split, whole tiles
    split = -(-(k // 2) // per_split)
    block_m = nf4_settings.block_rows(rows)
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    interpret = interpreted()
    main = nf4_triton.kernels(interpret)[0]
    nested = code2 is not None
    partial = split > 1
    target = torch.empty(split, rows, n, device=x.device, dtype=torch.float32) if partial else out
    xq = 1 if x.dtype == torch.bfloat16 else 2
    grid = (-(-n // block_n), split, -(-rows // block_m))
    counters = split_counters(x.device, grid[0] * grid[2]) if partial else None
    if lora is not None and partial and counters is None:
        return None
    weights = (packed, absmax, code2 if nested else absmax, absmax2 if nested else absmax,
               offset if nested else absmax, lut, bias if bias is not None else out)
    rp = 16 if lora is None else max(16, 1 << (lora[0].shape[0] - 1).bit_length())
    settings = {"BLOCKSIZE2": blocksize2, "HALF": half, "NB": tile // half, "BLOCK_N": block_n, "BLOCK_M": block_m,
                "NESTED": nested, "HAS_BIAS": bias is not None and (not partial or counters is not None),
                "PARTIAL": partial, "WQ": rounding, "XQ": xq, "EXACT": interpret, "EVEN": (k // 2) % tile == 0,
                "SPLITS": split if counters is not None else 0, "LORA": lora is not None, "RP": rp,
                "num_warps": warps, "num_stages": stages}
    branch = {}
    if lora is not None:  # the rank-space shares of each split (a split tile's last program sums them)
        first, second, scale = lora
        shares = torch.empty(grid[0] * grid[2], split, rp, block_m, device=x.device, dtype=torch.float32)
        branch = {"First": first, "Second": second, "SharesA": shares if partial else out, "R": first.shape[0],
                  "lora_scale": float(scale)}

    def tiles(xs: torch.Tensor, shuffle: bool) -> torch.Tensor:
        main[grid](xs, *weights, target, rows, n, k, xs.stride(0), per_split, SHUFFLE=shuffle, Final=out,
                   Counters=counters, **settings, **branch,
                   enable_fp_fusion=False)  # round a*b and +c apart, as bitsandbytes does
        return target if counters is None else out  # what it wrote

    tiles(x, not interpret and shuffles_hold(x, n, tiles, settings))
    if partial and counters is None:
        sum_splits(target, bias, out, xq, interpret)
    return out


def shuffles_hold(x: torch.Tensor, n: int, tiles: Callable[[torch.Tensor, bool], torch.Tensor],
                  settings: dict) -> bool:
    """Whether the tile kernel's warp-shuffle lookups read the table's values for a launch on x with `settings`:
    checked once per device, dtype, shape and settings (`_shuffles`), by `tiles(probe, shuffle)` (the launch; it
    returns what the kernel wrote) with and without them on a fixed nonzero x of x's shape and row stride, whose
    outputs must be equal bit for bit (the same float32 table values, the same arithmetic). False, the loads, where
    they differ or the shuffled build fails (logged), for x not 16-byte aligned (Triton builds another kernel then),
    and while a CUDA graph is being captured before any check (nothing may be compared then)."""
    if x.data_ptr() % 16:
        return False
    key = (x.device, x.dtype, *x.shape, x.stride(0), n, *settings.values())  # (launch builds settings in one order)
    held = _shuffles.get(key)
    if held is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False
        rows, k = x.shape
        probe = torch.empty_strided(x.shape, x.stride(), device=x.device, dtype=x.dtype)
        probe.copy_(((torch.arange(rows * k, device=x.device) % 13 - 6) / 8).view(rows, k))
        try:
            shuffled = tiles(probe, True).clone()
        except Exception as error:  # noqa: BLE001 (a build or launch of the inline PTX: the loads still run)
            log.warning("nf4 kernel: table lookups by warp shuffle could not run (%s: %s); loads instead",
                        type(error).__name__, error)
            held = False
        else:
            held = torch.equal(shuffled, tiles(probe, False))
            if not held:
                log.warning("nf4 kernel: table lookups by warp shuffle read other values than the loads with this "
                            "Triton build (%s); loads instead", key)
        _shuffles[key] = held
    return held


def lookups() -> str:
    """How the launches so far looked the table up, for the record: by warp shuffle where `shuffles_hold` found them
    reading what the loads read (each setting checked on its first launch), by loads otherwise."""
    if interpreted():
        return "table lookups by loads (Triton's interpreter runs no PTX)"
    held = sum(_shuffles.values())
    if not _shuffles:
        return "table lookups by warp shuffle where each setting's first launch matches the loads (none checked yet)"
    if held == len(_shuffles):
        return f"table lookups by warp shuffle (each setting checked against the loads: {held} of {held} equal so far)"
    return (f"table lookups by warp shuffle for {held} of {len(_shuffles)} settings checked, by loads for the rest "
            "(the shuffles read other values or did not build there)")


def sum_splits(target: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, xq: int, interpret: bool) -> None:
    """`out` = the K splits' fp32 shares `target` [split, rows, n] summed in order, `bias` added, rounded once.
    A program takes fewer outputs the more splits there are, so that each thread keeps at most 64 loads in flight."""
    split, rows, n = target.shape
    size = rows * n
    block = min(1024, 128 * (1 << ((max(1, 64 // split)).bit_length() - 1)))
    nf4_triton.kernels(interpret)[1][(-(-size // block),)](
        target, bias if bias is not None else out, out, size, n, SPLITS=split, HAS_BIAS=bias is not None, XQ=xq,
        EXACT=interpret, BLOCK=block, enable_fp_fusion=False)
