"""Does inductor copy a stacked group's output before the second-factor op? A token step's pattern alone.

Compiles rms-norm -> F.linear (base weights + first factors stacked) -> second-factor op -> split at Qwen3-VL-8B's
four group shapes and a token step's rows, and prints every Triton kernel the compiled code launches, each
buffer's strides and whether the outputs equal eager ones: once with the product's op (`vlmrl::stacked_second`,
tagged `flexible_layout`), once with the same kernel behind an op without the tag (inductor's default: the
eager strides, so a stacked output whose rows inductor padded is copied first). Needs CUDA.
Run: PYTHONPATH=src python benchmarks/layout_copies.py [ROWS]
"""

from __future__ import annotations

import re
import sys

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from vlmrl.bench import load_shapes
from vlmrl.engine.rollout import second_factors


def groups(text: dict) -> dict[str, tuple[int, list[int]]]:
    """Each stacked group's input width and output widths, from a shapes file's text config."""
    hidden, inner = text["hidden_size"], text["intermediate_size"]
    q, kv = text["num_attention_heads"] * text["head_dim"], text["num_key_value_heads"] * text["head_dim"]
    return {"qkv": (hidden, [q, kv, kv]), "o": (q, [hidden]), "gate_up": (hidden, [inner, inner]),
            "down": (inner, [hidden])}


def untagged_op():
    @torch.library.custom_op("vlmrl_probe::stacked_second_exact", mutates_args=())
    def op(stacked: torch.Tensor, second: torch.Tensor, scale: float) -> torch.Tensor:
        return second_factors._launch(stacked, second, None, scale)

    @op.register_fake
    def _(stacked, second, scale):
        return stacked.new_empty((*stacked.shape[:-1], second.shape[0]))
    return op


def step_of(op, w, second, norm, outs):
    def step(x):
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * norm
        return [o * 1.0 for o in op(F.linear(h, w), second, 2.0).split(outs, dim=-1)]
    return step


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    exact = untagged_op()
    dev, dt = "cuda", torch.bfloat16
    for name, (din, outs) in groups(load_shapes("qwen3_vl_8b")["text_config"]).items():
        width, ranks = sum(outs), 16 * len(outs)
        w = torch.randn(width + ranks, din, device=dev, dtype=dt) * 0.02
        second = torch.randn(width, ranks, device=dev, dtype=dt) * 0.02
        norm = torch.ones(din, device=dev, dtype=dt)
        x = torch.randn(rows, 1, din, device=dev, dtype=dt)
        for label, op in (("flexible_layout", second_factors.stacked_second), ("exact strides", exact)):
            step = step_of(op, w, second, norm, outs)
            torch._dynamo.reset()
            with torch.no_grad():
                got, codes = run_and_get_code(torch.compile(step), x)
                want = step(x)
            call = "\n".join(codes)
            call = call[call.find("def call("):]
            kernels = re.findall(r"(triton_\w+)\.run\(", call)
            strided = re.findall(r"empty_strided_cuda\((\([^)]*\)), (\([^)]*\))", call)
            same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            print(f"{name:8s} {label:16s} kernels {kernels} buffers {strided} equal {same}", flush=True)


if __name__ == "__main__":
    main()
