"""Does a compiled, CUDA-graphed step slow down when a static-address input is re-allocated before every batch
of calls? (diagnostic; benchmarks/NOTES.md, "Over many steps")

That is the rollout's situation: transformers builds a new static KV cache (tensors marked as static addresses)
for every `generate` call, and the CUDA graphs of the compiled decode step are re-recorded whenever it lands at
new addresses (`benchmarks/gpu_long_run.sh` counts 2 recordings per rollout). Each re-recording adds a node to
torch's CUDA-graph tree, and every later call checks the nodes in turn until one matches. This measures, for
300 "rollouts" of 20 calls each (stable parameters, a fresh static buffer per rollout, the allocator disturbed
in between), the host time per call and the number of recorded nodes.
Usage (CUDA): python benchmarks/cudagraph_rerecord.py OUTDIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch._inductor.cudagraph_trees as trees


def main(out: Path, rollouts: int = 300, calls: int = 20) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(200)]).cuda().half()  # 400 parameters

    @torch.compile(mode="reduce-overhead")
    def step(x, cache):
        cache.add_(1)
        return net(x) + cache[:1]

    x = torch.randn(8, 256, device="cuda", dtype=torch.half)
    rows = []
    for r in range(rollouts):
        junk = torch.empty((r % 7 + 1) * 2**20, device="cuda")  # what the loss pass does to the allocator
        cache = torch.zeros(2**20, device="cuda", dtype=torch.half)
        torch._dynamo.mark_static_address(cache)
        del junk
        step(x, cache)  # (re-)records
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            step(x, cache)
        torch.cuda.synchronize()
        manager = trees.get_container(0).tree_manager
        nodes = sum(len(v) for v in manager.roots.values()) if manager is not None else None
        rows.append({"rollout": r, "ms_per_call": 1e3 * (time.perf_counter() - start) / calls, "root_nodes": nodes})
    from torch._dynamo.utils import counters

    result = {"torch": torch.__version__, "rows": rows, "cudagraph_skips": dict(counters["inductor"])}
    (out / "cudagraph_rerecord.json").write_text(json.dumps(result, indent=1))
    for r in rows:
        if r["rollout"] in (1, 10, 50, 100, 127, 129, 150, 200, 250, rollouts - 1):
            print(r)
    print(result["cudagraph_skips"])


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "cudagraph-rerecord"))
