"""Each `generate` call's token step recorded once as one CUDA graph and replayed, with no dynamo on the host.

With `torch.compile(mode="reduce-overhead")`, before every token step dynamo checks its guards (thousands, on the
model's attributes and inputs) and runs the compiled frame's Python prologue, and inductor's CUDA graph trees check
and copy their inputs, then launch one graph per compiled piece: on the host, that took longer than the GPU's own
work of a 4-bit token step (benchmarks/NOTES.md, "The token step as one CUDA graph"). Here the token step is
compiled without CUDA graph trees (inductor's kernels, launched from Python), and once a step of the call has run
without compiling anything, that step is run once more and recorded in one `torch.cuda.CUDAGraph` around the whole
compiled call; every later step of the call copies its input tensors into the graph's and replays it: one launch, no
guards. The kernels are the compiled step's own, so the tokens and log-probabilities are too.

- `StepGraph`: one call's token step. Its inputs are keyed over every leaf, inside dicts and lists too
  (`signature`: each tensor's shape, strides, dtype and device; None, numbers and strings by value; any other
  object, the cache for one, by identity, held while recorded); a step whose key differs from the recorded one runs
  compiled and is recorded again once steady (at most `MAX_RECORDINGS` a call). A step that returns hidden states or
  attentions is not recorded (`generate` keeps those across steps, and a replay writes over them).
  Recording runs the step once more (the warm-up a capture needs): the cache's position counters it advances
  (transformers' static layers keep theirs in a tensor, `cumulative_length`) are put back after, and the keys and
  values it wrote one position ahead are written over by the next step before anything reads them.
- `step_graphs(model, graphs, on_failure)`: inside the block, the compiled call `generate` takes (its
  `get_compiled_call`, transformers 5.x, once per call) is a `StepGraph`.
- `RolloutGraphs(config)`: a trainer's rollouts, for its life, compiled in `RECORDED_MODE`: the first step that
  cannot be recorded (said once, with why) puts the trainer's compile mode back to the one it had (CUDA graph
  trees) for the rollouts after, and its own call finishes compiled.
`vlmrl.engine.rollout.fast` turns it on where it was measured (`fast.step_graph_reason`, which asks `cuda_reason`
where the weights are). Limits: CUDA only; a cache of other layers than transformers' full-attention `StaticLayer`
(sliding-window ones keep Python numbers) is refused, not recorded (`fast.step_graph_reason` keeps models with such
layers off it from the start); a call's graph goes when the next call starts or the block ends (each rollout's
adapter copies and rope offsets are new tensors); Python state the compiled step would change at each call, other
than those counters, is changed only when it runs compiled.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from vlmrl.engine.patch import replaced

log = logging.getLogger(__name__)
MAX_RECORDINGS = 4  # recordings per `generate` call before its steps stay compiled (a key that keeps changing)
RECORDED_MODE = "default"  # torch.compile's mode under recorded steps: inductor's kernels, no CUDA graph trees


def flatten(kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """The arguments' leaves and structure, opening Python's dicts, lists and tuples only: a cache object stays one
    leaf even where its type is registered with torch's pytree (transformers registers `DynamicCache` for export),
    so it is read in place, never copied."""
    return pytree.tree_flatten(kwargs, is_leaf=lambda value: not isinstance(value, (dict, list, tuple)))


def signature(kwargs: dict[str, Any]) -> tuple:
    """What a recorded step's inputs must match, over every leaf of the arguments (dicts and lists included, e.g. a
    mask given as a dict of masks): their structure; each tensor's shape, strides, dtype and device; None, numbers
    and strings by value; any other object by identity (the cache, for one: a `StepGraph` holds the recorded ones,
    so an identity cannot be reused by another object)."""
    return leaves_signature(*flatten(kwargs))


def leaves_signature(leaves: list[Any], spec: Any) -> tuple:
    """`signature` of arguments already flattened (`flatten`)."""
    key: list[tuple] = []
    for value in leaves:
        if isinstance(value, torch.Tensor):
            key.append(("tensor", tuple(value.shape), value.stride(), value.dtype, str(value.device)))
        elif value is None or isinstance(value, (bool, int, float, str)):
            key.append(("value", type(value).__name__, value))
        else:
            key.append(("object", id(value)))
    return spec, tuple(key)


def position_counters(kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], str | None]:
    """The tensors a token step advances in place besides the cache's keys and values (each cache layer's
    `cumulative_length`, for any cache among the arguments), and why the step cannot be recorded, or None: a
    transformers cache layer other than the full-attention `StaticLayer` (sliding-window, indexed, linear-attention
    layers keep state a replay would not update), or a layer that keeps its position in a Python number."""
    from transformers.cache_utils import StaticLayer

    counters: list[torch.Tensor] = []
    for value in kwargs.values():
        for layer in getattr(value, "layers", None) or ():
            kind = type(layer)
            if kind.__module__.startswith("transformers.") and kind is not StaticLayer:
                return [], f"the cache's {kind.__name__} is not a full-attention static layer"
            counter = getattr(layer, "cumulative_length", None)
            if isinstance(counter, torch.Tensor):
                counters.append(counter)
            elif counter is not None:
                return [], f"the cache's {kind.__name__} keeps its position in a Python number"
    return counters, None


def cuda_reason(model: Any) -> str | None:
    """Why CUDA graphs cannot record `model`'s token steps where its weights are, or None (on CUDA, or not a module)."""
    device = next((p.device for p in model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    if device is None or device.type == "cuda":
        return None
    return f"weights on {device} (CUDA graphs need a CUDA device)"


class CudaGraphs:
    """Record and replay with `torch.cuda.CUDAGraph` (a warm-up run on a side stream first, as CUDA graphs need)."""

    def record(self, step: Callable[[], Any]) -> tuple[Any, Callable[[], None]]:
        caller = torch.cuda.current_stream()
        stream = torch.cuda.Stream()
        stream.wait_stream(caller)
        try:
            with torch.cuda.stream(stream):
                step()
            caller.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                output = step()
        except BaseException:
            # a capture that failed can leave the capture's stream current (its exit raises before restoring it)
            torch.cuda.set_stream(caller)
            torch.cuda.synchronize()
            raise
        return output, graph.replay


class StepGraph:
    """One `generate` call's compiled token step: run compiled until a step compiles nothing, then recorded by
    `graphs` and replayed while the inputs' `signature` holds (see the module's docstring). `on_failure(why)` is
    called when a step cannot be recorded; the call's steps then stay compiled."""

    def __init__(self, compiled: Callable[..., Any], graphs: Any,
                 on_failure: Callable[[str], None] | None = None):
        self.compiled, self.graphs, self.on_failure = compiled, graphs, on_failure
        self.key: tuple | None = None
        self.leaves: list[Any] = []  # the recorded inputs' leaves: the graph's input tensors, the objects it read
        self.output: Any = None
        self.replay: Callable[[], None] | None = None
        self.recordings = 0
        self.replays = 0
        self.failed: str | None = None

    def __call__(self, **kwargs: Any) -> Any:
        leaves, spec = flatten(kwargs)
        key = leaves_signature(leaves, spec)
        if self.replay is not None:
            if key == self.key:
                for buffer, value in zip(self.leaves, leaves, strict=True):
                    if isinstance(buffer, torch.Tensor):
                        buffer.copy_(value)
                self.replay()
                self.replays += 1
                return self.output
            self.release()  # a new key: run compiled again, and record it once steady
        from torch._dynamo.utils import counters

        compiles = counters["frames"]["total"]
        output = self.compiled(**kwargs)
        if counters["frames"]["total"] == compiles and self.failed is None and self.recordings < MAX_RECORDINGS:
            self._record(kwargs, leaves, spec, key)
        return output

    def release(self) -> None:
        """Let the recorded graph, its inputs and its output go (the counts stay)."""
        self.key, self.leaves, self.output, self.replay = None, [], None, None

    def _record(self, kwargs: dict[str, Any], leaves: list[Any], spec: Any, key: tuple) -> None:
        """Record the step `kwargs` (flattened: `leaves`, `spec`) just ran (`graphs` runs it once more first, on copies
        of its inputs)."""
        counters, refused = position_counters(kwargs)
        if refused is None and (kwargs.get("output_hidden_states") or kwargs.get("output_attentions")):
            refused = "hidden states or attentions are kept across steps, and a replay would overwrite them"
        if refused is not None:
            self._fail(refused)
            return
        leaves = [value.clone() if isinstance(value, torch.Tensor) else value for value in leaves]
        inputs = pytree.tree_unflatten(leaves, spec)
        before = [counter.clone() for counter in counters]
        self.recordings += 1
        try:
            output, replay = self.graphs.record(lambda: self.compiled(**inputs))
        except Exception as error:  # noqa: BLE001  recording is an optimization: the step stays compiled
            why = f"{type(error).__name__}: {error}".splitlines()[0]
            if error.__context__ is not None:  # a failed capture's exit raises over what made it fail
                context = error.__context__
                why += f" (after {type(context).__name__}: {str(context).splitlines()[0] if str(context) else ''})"
            self._fail(why)
            return
        finally:
            for counter, value in zip(counters, before, strict=True):
                counter.copy_(value)
        self.key, self.leaves, self.output, self.replay = key, leaves, output, replay

    def _fail(self, why: str) -> None:
        self.failed = why
        log.warning("the token step could not be recorded as one CUDA graph (%s); this generate call's steps stay "
                    "compiled", why)
        if self.on_failure is not None:
            self.on_failure(why)


@contextlib.contextmanager
def step_graphs(model: Any, graphs: Any = None,
                on_failure: Callable[[str], None] | None = None) -> Iterator[list[StepGraph]]:
    """Inside the block, each `generate` call's compiled token steps run as a `StepGraph` recorded by `graphs`
    (`CudaGraphs()` when None). Yields the list of the calls' `StepGraph`s. Nothing changes for a model that is not
    a transformers generator."""
    from vlmrl.engine.rollout.attention import base_model

    made: list[StepGraph] = []
    base = base_model(model)
    original = getattr(base, "get_compiled_call", None)
    if original is None:
        yield made
        return
    graphs = graphs if graphs is not None else CudaGraphs()

    def get_compiled_call(compile_config: Any) -> Callable[..., Any]:
        if made:
            made[-1].release()  # the call before has ended: its graph goes
        made.append(StepGraph(original(compile_config), graphs, on_failure))
        return made[-1]

    try:
        with replaced(base, "get_compiled_call", get_compiled_call):
            yield made
    finally:
        for call in made:
            call.release()


class RolloutGraphs:
    """A trainer's rollouts with their token steps recorded (`step_graphs`), for its life. `config` is the
    GenerationConfig that compiles them: its `compile_config`'s mode becomes `RECORDED_MODE` (no CUDA graph trees),
    and the mode it had is `fallback_mode`, which the first step that cannot be recorded puts back, turning
    recording off for the rollouts after (`off` says why)."""

    def __init__(self, config: Any, graphs: Any = None):
        self.config, self.fallback_mode, self.graphs = config, config.compile_config.mode, graphs
        config.compile_config.mode = RECORDED_MODE
        self.off: str | None = None
        self.replays = 0  # token steps replayed, over the trainer's life

    @contextlib.contextmanager
    def active(self, model: Any) -> Iterator[None]:
        if self.off is not None:
            yield
            return
        with step_graphs(model, self.graphs, self._failed) as made:
            yield
        self.replays += sum(call.replays for call in made)

    def _failed(self, why: str) -> None:
        if self.off is None:
            self.off = why
            self.config.compile_config.mode = self.fallback_mode
            log.warning("token steps go back to CUDA graph trees (torch.compile mode %s) from the next rollout on",
                        self.fallback_mode)
