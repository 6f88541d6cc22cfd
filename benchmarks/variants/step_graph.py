"""Each `generate` call's token step recorded once as a whole CUDA graph and replayed, with no dynamo on the host.

The product decodes through `torch.compile(mode="reduce-overhead")`: before every token step dynamo checks its
guards (thousands, on the model's attributes and inputs) and runs the compiled frame's Python prologue, and
inductor's CUDA graph trees check and copy their inputs, then launch one graph per compiled piece. On an H100 that
host work took longer than the GPU's own work of a 4-bit token step (benchmarks/NOTES.md). Here the token step is
compiled without CUDA graphs (inductor's kernels, launched from Python), and once a step of the call has run
without compiling anything, the next one is recorded in one `torch.cuda.CUDAGraph` around the whole compiled call;
every later step of the call copies its input tensors into the graph's and replays it: one launch, no guards.

`step_graphs(model, graphs=CudaGraphs())`: inside the block, `generate`'s compiled token step (its
`get_compiled_call`, transformers 5.x, called once per `generate` call) is a `StepGraph`. Within one call the static
cache, the weights, the batch and every shape are fixed; a step's inputs are keyed (`signature`: each tensor's
shape, strides, dtype and device; any other argument's value, or its identity) and a step whose key differs from
the recorded one runs compiled, as does every step where recording failed (said once, with why). Recording runs
the step once more (the warm-up before the capture): the cache's position counters it advances (transformers'
static layers keep theirs in a tensor, `cumulative_length`) are put back after, and the keys and values it wrote
one position ahead are written over by the next step before anything reads them. Limits: CUDA only (elsewhere, or
with `graphs=None`, it changes nothing); graphs are not kept across calls (each call's adapter copies and rope
offsets are new tensors); whatever Python state the compiled step would change at each call is changed only when
it runs compiled, so a model whose token step keeps Python-side counters is not for it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vlmrl.engine.patch import replaced

log = logging.getLogger(__name__)
MAX_RECORDINGS = 4  # recordings per `generate` call before its steps stay compiled (a key that keeps changing)


def signature(kwargs: dict[str, Any]) -> tuple:
    """What a recorded step's inputs must match: each tensor's shape, strides, dtype and device; None, numbers and
    strings by value; any other object by identity (the cache object, for one)."""
    key = []
    for name in sorted(kwargs):
        value = kwargs[name]
        if isinstance(value, torch.Tensor):
            key.append((name, "tensor", tuple(value.shape), value.stride(), value.dtype, str(value.device)))
        elif value is None or isinstance(value, (bool, int, float, str)):
            key.append((name, "value", type(value).__name__, value))
        else:
            key.append((name, "object", id(value)))
    return tuple(key)


class CudaGraphs:
    """Record and replay with `torch.cuda.CUDAGraph` (a warm-up run on a side stream first, as CUDA graphs need)."""

    def record(self, step: Callable[[], Any]) -> tuple[Any, Callable[[], None]]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = step()
        return output, graph.replay


class StepGraph:
    """One `generate` call's compiled token step: run compiled until a step compiles nothing, then recorded by
    `graphs` and replayed while the inputs' `signature` holds (see the module's docstring)."""

    def __init__(self, compiled: Callable[..., Any], graphs: Any):
        self.compiled, self.graphs = compiled, graphs
        self.key: tuple | None = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.output: Any = None
        self.replay: Callable[[], None] | None = None
        self.recordings = 0
        self.replays = 0
        self.failed: str | None = None

    def __call__(self, **kwargs: Any) -> Any:
        key = signature(kwargs)
        if self.replay is not None:
            if key == self.key:
                for name, buffer in self.inputs.items():
                    buffer.copy_(kwargs[name])
                self.replay()
                self.replays += 1
                return self.output
            self.replay = None  # a new key: run compiled again, and record it once steady
        from torch._dynamo.utils import counters

        compiles = counters["frames"]["total"]
        output = self.compiled(**kwargs)
        if counters["frames"]["total"] == compiles and self.failed is None and self.recordings < MAX_RECORDINGS:
            self._record(kwargs, key)
        return output

    def _record(self, kwargs: dict[str, Any], key: tuple) -> None:
        inputs = {name: value.clone() for name, value in kwargs.items() if isinstance(value, torch.Tensor)}
        counters = position_counters(kwargs)
        before = [counter.clone() for counter in counters]
        self.recordings += 1
        try:
            output, replay = self.graphs.record(lambda: self.compiled(**{**kwargs, **inputs}))
        except Exception as error:  # noqa: BLE001  recording is an optimization: the step stays compiled
            self.failed = f"{type(error).__name__}: {error}".splitlines()[0]
            log.warning("step_graph: the token step could not be recorded as a CUDA graph (%s); this generate "
                        "call's steps stay compiled", self.failed)
            return
        finally:
            for counter, value in zip(counters, before, strict=True):
                counter.copy_(value)
        self.key, self.inputs, self.output, self.replay = key, inputs, output, replay


def position_counters(kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a token step advances in place besides the cache's keys and values: each cache layer's
    `cumulative_length` (transformers' static layers, 5.x), for any cache object among the arguments."""
    return [layer.cumulative_length for value in kwargs.values() for layer in getattr(value, "layers", None) or ()
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]


@contextlib.contextmanager
def step_graphs(model: Any, graphs: Any = "cuda") -> Iterator[list[StepGraph]]:
    """Inside the block, each `generate` call's compiled token steps run as a `StepGraph` (recorded by `graphs`:
    `CudaGraphs()` by default where CUDA is, else nothing changes). Yields the list of the calls' `StepGraph`s, for
    the caller to read their counts."""
    from vlmrl.engine.rollout.attention import base_model

    made: list[StepGraph] = []
    if graphs == "cuda":
        graphs = CudaGraphs() if torch.cuda.is_available() else None
    base = base_model(model)
    original = getattr(base, "get_compiled_call", None)
    if original is None or graphs is None:
        yield made
        return

    def get_compiled_call(compile_config: Any) -> Callable[..., Any]:
        made.append(StepGraph(original(compile_config), graphs))
        return made[-1]

    with replaced(base, "get_compiled_call", get_compiled_call):
        yield made
