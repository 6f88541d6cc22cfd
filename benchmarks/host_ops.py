"""The eager work a compiled token step does outside its compiled graph, on the CPU: the top-level torch ops per
token step, by the source line that issued them.

On a GPU each of these is a kernel launch (or a dispatch) the host makes at every token step, beside dynamo's guard
checks and the graph's launch: where the host bounds the token step (benchmarks/NOTES.md, "The word loop, the
in-kernel split sum, and where the 4-bit token step's wall time goes"), they are part of what it waits on. Which
ops a step issues does not depend on the device or the model's size, so a tiny model on the CPU lists them: a tiny
random Qwen3-VL with LoRA and the rollout's stacked projections (`guard_checks.compiled_policy`), decoding compiled
as vlmrl's generation does (static bucketed cache, the stop check read a step late, ended rows masked, each step's
own token type ids), sampling at temperature 1. One warm-up `generate` call, then one profiled; the ops counted are
those not nested in another op, issued after the first compiled token step began and outside every compiled region
(the prompt pass is eager by design and left out). What each costs on a GPU is for a GPU run to measure
(benchmarks/token_step_timeline.py).

    python benchmarks/host_ops.py OUTDIR [TOKENS] [LAYERS]
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import torch
from guard_checks import compiled_policy, decoding_as_vlmrl, seeded_in_tmp
from torch.profiler import ProfilerActivity, profile

SOURCES = ("transformers/", "vlmrl/", "trl/", "peft/")  # the frames an op is attributed to (the innermost of them)


def ancestors(event):
    """The profiler events `event` ran inside, innermost first."""
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def source(event) -> str:
    """The innermost Python frame of vlmrl or a library it drives above `event`, as the profiler names it."""
    return next((p.name for p in ancestors(event) if any(name in p.name for name in SOURCES)), "(elsewhere)")


def nested(event) -> bool:
    """Whether `event` ran inside another torch op (counted with it, not apart)."""
    return any(p.name.startswith("aten::") for p in ancestors(event))


def census(tokens: int, layers: int, work: Path) -> dict:
    policy, stack, batch, settings = compiled_policy(layers, work, prompts=4)
    call = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": True, "temperature": 1.0, "top_k": 0,
            "top_p": 1.0, **settings}
    with decoding_as_vlmrl(policy, stack):
        policy.generate(**batch, **call)  # compiles
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            policy.generate(**batch, **call)
    events = prof.events()
    regions = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("Torch-Compiled Region")]
    if not regions:
        raise SystemExit("no compiled region ran: nothing to count outside it")
    first = min(start for start, _ in regions)
    eager = [e for e in events if e.name.startswith("aten::") and e.time_range.start > first and not nested(e)
             and not any(a <= e.time_range.start and e.time_range.end <= b for a, b in regions)]
    by_op = collections.Counter(e.name for e in eager)
    by_source = collections.Counter(source(e) for e in eager)
    return {"tokens": tokens, "layers": layers, "compiled_regions_per_step": len(regions) / tokens,
            "ops_per_step": len(eager) / tokens, "torch": torch.__version__,
            "by_source": {k: v / tokens for k, v in by_source.most_common()},
            "by_op": {k: v / tokens for k, v in by_op.most_common()}}


def markdown(record: dict) -> str:
    title = (f"Eager ops per compiled token step, outside the compiled graph: tiny Qwen3-VL ({record['layers']} "
             f"layers, hidden 64) + LoRA, {record['tokens']} sampled tokens, torch {record['torch']}, CPU")
    counts = (f"{record['ops_per_step']:.1f} top-level ops per token step; "
              f"{record['compiled_regions_per_step']:.2f} compiled regions entered per token step.")
    lines = [title, "", counts, "", "| issued by | ops per token step |", "|---|---|"]
    lines += [f"| `{name}` | {count:.2f} |" for name, count in record["by_source"].items() if count >= 0.5]
    lines += ["", "| op | per token step |", "|---|---|"]
    lines += [f"| `{name}` | {count:.2f} |" for name, count in record["by_op"].items() if count >= 0.5]
    return "\n".join(lines) + "\n"


def main(out: Path, tokens: int, layers: int) -> None:
    record = seeded_in_tmp(out, lambda work: census(tokens, layers, work))
    (out / "host_ops.json").write_text(json.dumps(record, indent=2))
    (out / "host_ops.md").write_text(markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 32,
         int(sys.argv[3]) if len(sys.argv) > 3 else 2)
