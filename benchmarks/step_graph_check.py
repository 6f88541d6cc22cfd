"""Whether a tiny Qwen3-VL (or another family: ARCH) decodes the same tokens when each `generate` call's token step is
recorded as one graph and replayed (`vlmrl.engine.rollout.step_graph`) as when every step runs compiled.

A tiny random model with LoRA and the rollout's stacked projections (`guard_checks.compiled_policy`), decoding
compiled as vlmrl's generation does (static bucketed cache, the stop check read a step late, ended rows masked,
each step's own token type ids), greedy, two `generate` calls each way. On CUDA the model runs in bf16, compiled by
inductor without CUDA graph trees, and the steps are recorded in real CUDA graphs; on the CPU dynamo compiles with an
eager backend and a stand-in records them (it runs the step again at each replay and writes the new logits into the
recorded output, as a replay does), which checks what the variant does around transformers' loop, not CUDA graphs.
Writes OUT/step_graph_check.json; exits 1 when the tokens differ or no step was replayed.

    python benchmarks/step_graph_check.py OUTDIR [TOKENS] [LAYERS] [ARCH]   (ARCH: qwen3_vl, qwen2_5_vl, idefics3;
                                                                            OUTDIR/step_graph_check_ARCH.json)
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
from guard_checks import compiled_policy, decoding_as_vlmrl, seeded_in_tmp

from vlmrl.engine.rollout.stacked import StackedProjections
from vlmrl.engine.rollout.step_graph import CudaGraphs, step_graphs


class StandIn:
    """`CudaGraphs`' contract without a GPU: a replay runs the step and writes its logits into the recorded output."""

    def record(self, step):
        output = step()
        return output, lambda: output.logits.copy_(step().logits)


def check(tokens: int, layers: int, work: Path, arch: str = "qwen3_vl") -> dict:
    policy, stack, batch, settings = compiled_policy(layers, work, prompts=4, arch=arch)
    cuda = torch.cuda.is_available()
    if cuda:
        policy = policy.to("cuda", torch.bfloat16)
        stack = StackedProjections(policy)  # stacked from the weights on the GPU
        batch = {k: v.to("cuda") if hasattr(v, "to") else v for k, v in batch.items()}
        settings["compile_config"].backend, settings["compile_config"].mode = "inductor", "default"
    call = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False, **settings}
    runs: dict = {}
    for name, graphs in (("compiled", None), ("recorded", CudaGraphs() if cuda else StandIn())):
        wrap = step_graphs(policy, graphs) if graphs is not None else contextlib.nullcontext([])
        with decoding_as_vlmrl(policy, stack), wrap as made:
            runs[name] = [policy.generate(**batch, **call).tolist() for _ in range(2)]
        runs[f"{name} calls"] = [{"replays": c.replays, "recordings": c.recordings, "failed": c.failed} for c in made]
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "arch": arch, "tokens": tokens, "layers": layers, "same_tokens": runs["compiled"] == runs["recorded"],
            "calls": runs["recorded calls"]}


def main(out: Path, tokens: int, layers: int, arch: str = "qwen3_vl") -> int:
    result = seeded_in_tmp(out, lambda work: check(tokens, layers, work, arch))
    name = "step_graph_check.json" if arch == "qwen3_vl" else f"step_graph_check_{arch}.json"
    (out / name).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0 if result["same_tokens"] and all(c["replays"] > 0 for c in result["calls"]) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 24,
                  int(sys.argv[3]) if len(sys.argv) > 3 else 2, sys.argv[4] if len(sys.argv) > 4 else "qwen3_vl"))
