"""The token step recorded once as one graph and replayed (vlmrl.engine.rollout.step_graph), on the CPU: a stand-in
records (it runs the step again at each replay and writes the new logits into the recorded output, as a CUDA
graph's replay does), so what is checked is the keying, the inputs copied, the cache's position put back after
recording, the refusals and the trainer going back to CUDA graph trees. Real CUDA graphs in transformers' loop:
benchmarks/step_graph_check.py (tokens each way on a tiny Qwen3-VL) and the bench's mismatch columns
(benchmarks/NOTES.md, "The token step as one CUDA graph")."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vlmrl.engine.rollout.step_graph import (
    RolloutGraphs,
    StepGraph,
    position_counters,
    signature,
    step_graphs,
)


class Replayed:
    """`CudaGraphs`' contract where no GPU is: `record` runs the step once and returns its output; a replay runs it
    again and writes the new values into that output's tensors."""

    def __init__(self, fail: bool = False):
        self.fail, self.records = fail, 0

    def record(self, step):
        self.records += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        output = step()
        return output, lambda: output.logits.copy_(step().logits)


def _capture_end_over_its_cause(step):
    """A capture whose end raises while its cause is being handled, as `torch.cuda.graph`'s exit does."""
    try:
        raise RuntimeError("operation not permitted when stream is capturing")
    except RuntimeError:
        raise RuntimeError("the capture was invalidated")


def static_cache(length, layer=None):
    """A static cache as transformers 5.x keeps one: values, and a layer whose position counter is a tensor."""
    return SimpleNamespace(values=torch.zeros(length),
                           layers=[layer or SimpleNamespace(cumulative_length=torch.tensor(0))])


def cache_step(input_ids, past_key_values, return_dict=True, attention_mask=None):
    """A token step: writes the step's value (plus its mask's, given as transformers' dict of masks) at the cache's
    position and advances it, reads the positions so far."""
    layer = past_key_values.layers[0]
    position = int(layer.cumulative_length)
    masks = sum(mask.float().sum() for mask in (attention_mask or {}).values())
    past_key_values.values[position] = input_ids.float().sum() + masks
    if isinstance(layer.cumulative_length, torch.Tensor):
        layer.cumulative_length.add_(1)
    else:
        layer.cumulative_length += 1
    return SimpleNamespace(logits=(past_key_values.values[: position + 1].sum() * 2).reshape(1, 1))


def test_a_recorded_step_replays_with_each_steps_inputs_and_records_again_for_a_new_key():
    cache, reference = static_cache(8), static_cache(8)
    graphs = Replayed()
    call = StepGraph(cache_step, graphs)
    for position in range(5):
        ids = torch.tensor([[position + 1], [3]])
        got = call(input_ids=ids, past_key_values=cache, return_dict=True).logits.clone()
        assert torch.equal(got, cache_step(ids, reference).logits)
    # the recording ran the step again: its position was put back, so every step wrote where the plain ones did
    assert torch.equal(cache.values, reference.values) and int(cache.layers[0].cumulative_length) == 5
    assert (graphs.records, call.recordings, call.replays) == (1, 1, 4)  # recorded after the first step
    call(input_ids=torch.tensor([[1], [2], [3]]), past_key_values=cache)  # another shape: compiled, then recorded
    assert (call.recordings, call.replays) == (2, 4) and call.key[1][0][1] == (3, 1)
    assert signature({"a": None, "b": 2}) != signature({"a": None, "b": 3})  # values are part of the key
    assert signature({"c": cache.values}) != signature({"c": cache.values.view(2, 4)})


def test_tensors_inside_containers_are_inputs_too():
    """A mask given as a new dict each step (transformers' masks for models with `layer_types`) is keyed by its
    leaves, not by the dict's identity, and its tensor copied in at each replay."""
    cache, reference = static_cache(6), static_cache(6)
    call = StepGraph(cache_step, Replayed())
    for position in range(6):
        masks = {"full_attention": torch.arange(6) <= position}  # a static length, new values each step
        got = call(input_ids=torch.tensor([[1]]), past_key_values=cache, attention_mask=masks).logits.clone()
        assert torch.equal(got, cache_step(torch.tensor([[1]]), reference, attention_mask=masks).logits)
    assert (call.recordings, call.replays) == (1, 5)
    held = call.leaves[1]  # the recorded cache: held, so no other object can take its identity
    assert held is cache
    call.release()
    assert call.leaves == [] and call.output is None and call.replay is None


def test_a_step_that_cannot_be_recorded_stays_compiled_and_says_why(caplog):
    cache, failures = static_cache(4), []
    call = StepGraph(cache_step, Replayed(fail=True), failures.append)
    for _ in range(3):
        call(input_ids=torch.tensor([[1]]), past_key_values=cache)
    assert failures == [call.failed] == ["RuntimeError: operation not permitted when stream is capturing"]
    assert call.recordings == 1 and call.replays == 0 and cache.values.tolist() == [1, 1, 1, 0]
    assert caplog.text.count("could not be recorded") == 1
    chained = StepGraph(cache_step, SimpleNamespace(record=_capture_end_over_its_cause), [].append)
    chained(input_ids=torch.tensor([[1]]), past_key_values=static_cache(4))  # runs, then its recording fails
    assert chained.failed == ("RuntimeError: the capture was invalidated (after RuntimeError: operation not permitted "
                              "when stream is capturing)")


def test_a_cache_that_keeps_its_position_in_a_python_number_is_not_recorded():
    python_counter = static_cache(4, SimpleNamespace(cumulative_length=0))  # transformers' sliding layers keep an int
    assert position_counters({"cache": python_counter})[1] == (
        "the cache's SimpleNamespace keeps its position in a Python number")
    graphs, failures = Replayed(), []
    call = StepGraph(cache_step, graphs, failures.append)
    outputs = [float(call(input_ids=torch.tensor([[2]]), past_key_values=python_counter).logits) for _ in range(3)]
    assert graphs.records == 0 and len(failures) == 1 and outputs == [4, 8, 12]  # compiled, every step
    counters, why = position_counters({"cache": static_cache(2), "ids": torch.ones(1)})
    assert why is None and [int(c) for c in counters] == [0]
    from transformers.cache_utils import DynamicLayer, StaticLayer

    static = StaticLayer(max_cache_len=4)
    assert position_counters({"cache": SimpleNamespace(layers=[static])})[1] is None
    assert position_counters({"cache": SimpleNamespace(layers=[static, DynamicLayer()])})[1] == (
        "the cache's DynamicLayer is not a full-attention static layer")
    kept = StepGraph(lambda **kwargs: cache_step(kwargs["input_ids"], kwargs["past_key_values"]), Replayed())
    kept(input_ids=torch.tensor([[1]]), past_key_values=static_cache(2), output_hidden_states=True)
    assert kept.failed.startswith("hidden states or attentions are kept across steps")


def test_the_first_failure_puts_the_trainer_back_on_graph_trees_for_the_rollouts_after(caplog):
    class Generator(torch.nn.Module):
        """A model whose `generate` calls its compiled call as transformers does, once per token step."""

        def get_compiled_call(self, compile_config):
            return cache_step

        def generate(self, steps, cache):
            call = self.get_compiled_call(None)
            return [float(call(input_ids=torch.tensor([[1]]), past_key_values=cache).logits) for _ in range(steps)]

    model = Generator()
    config = SimpleNamespace(compile_config=SimpleNamespace(mode="reduce-overhead"))
    rollouts = RolloutGraphs(config, graphs=Replayed())
    with rollouts.active(model):
        assert model.generate(4, static_cache(8)) == [2, 4, 6, 8]
    assert rollouts.replays == 3 and rollouts.off is None and config.compile_config.mode == "default"
    rollouts.graphs = Replayed(fail=True)
    with rollouts.active(model):
        assert model.generate(3, static_cache(8)) == [2, 4, 6]
    assert rollouts.off.startswith("RuntimeError") and config.compile_config.mode == "reduce-overhead"
    with rollouts.active(model):  # off for good: nothing wraps the model's compiled call
        assert model.get_compiled_call(None) is cache_step
    assert "back to CUDA graph trees" in caplog.text
    with step_graphs(torch.nn.Linear(2, 2)) as made:  # not a generator: nothing changes
        assert made == []


def test_the_fast_path_records_token_steps_only_where_it_was_measured():
    from vlmrl.engine.rollout.fast import step_graph_reason

    def trainer(layer_types=None, nf4=True):
        text = SimpleNamespace(layer_types=layer_types)
        return SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text)),
                               vlmrl_nf4_decode=object() if nf4 else None)

    assert step_graph_reason(trainer(["full_attention"] * 4), mode="reduce-overhead", kernels=True) is None
    assert step_graph_reason(trainer(), mode="default", kernels=True) == "torch.compile mode default"
    assert step_graph_reason(trainer(), mode="reduce-overhead", kernels=False) == "vlmrl's kernels are off"
    assert step_graph_reason(trainer(nf4=False), mode="reduce-overhead", kernels=True) is None  # bf16: on
    assert step_graph_reason(trainer(), mode="reduce-overhead", kernels=True, quantized=True) is None
    assert "stay on bitsandbytes" in step_graph_reason(trainer(nf4=False), mode="reduce-overhead", kernels=True,
                                                       quantized=True)
    fsdp = trainer(["full_attention"])
    fsdp.is_fsdp_enabled = True
    assert step_graph_reason(fsdp, mode="reduce-overhead", kernels=True) == "parameters are sharded by FSDP / DeepSpeed"
    on_cpu = SimpleNamespace(model=torch.nn.Linear(2, 2))
    assert step_graph_reason(on_cpu, mode="reduce-overhead", kernels=True) == (
        "weights on cpu (CUDA graphs need a CUDA device)")
    gemma = trainer(["sliding_attention"] * 5 + ["full_attention"])
    assert step_graph_reason(gemma, mode="reduce-overhead", kernels=True) == (
        "the model has sliding_attention layers, whose cache a replay would not update")


def test_a_cache_stays_one_leaf_even_where_torch_s_pytree_knows_its_type():
    """transformers registers `DynamicCache` with torch's pytree (for export): flattened there, a recording would
    copy the cache and write into the copy. Only Python's containers are opened."""
    import torch.utils._pytree as pytree

    from vlmrl.engine.rollout.step_graph import flatten

    class Registered:
        def __init__(self, keys):
            self.keys = keys

    pytree.register_pytree_node(Registered, lambda c: ([c.keys], None), lambda leaves, _: Registered(leaves[0]))
    cache = Registered(torch.zeros(3))
    assert len(pytree.tree_leaves({"c": cache})) == 1 and pytree.tree_leaves({"c": cache})[0] is not cache
    leaves, _ = flatten({"c": cache, "m": {"full": torch.ones(2)}, "ids": [torch.ones(1)]})
    assert leaves[0] is cache and len(leaves) == 3
