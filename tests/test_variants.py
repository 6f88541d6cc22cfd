"""The bench plugins in benchmarks/variants/ (the engine's A/B variants that lost or tied, outside the product), on
the CPU and quickly: the one hook (`vlmrl.bench.run.VARIANTS`) and what each registered path changes; a variant
setting up the engine in place of `vlmrl_engine` from outside (stacking turned off, the merge, PEFT's input cast);
`apply` putting each rollout variant in its place and recording it; the merged rollout computing the adapter's
output and restoring the base weights bit for bit; the filled-cache window's attention; the nf4 variants' records.

Left to the benchmarks that run them (no longer in the suite, which they slowed: they compiled tiny models or ran
many Triton-interpreter launches): guards checked once on a compiled tiny Qwen3-VL (tests/test_guards_once.py),
greedy and compiled decoding over the filled window (most of tests/test_attend_filled.py), the nf4 LoRA fold's
and the summed form's numerics (tests/test_nf4_lora.py), and the first nf4 design's numerics (test_nf4.py's "v1").
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import AttentionModule, Block, Net, fake_trainer, lora_net, lora_policy, nf4_block
from vlmrl.engine.lora_layers import lora_layers
from vlmrl.engine.rollout import attention
from vlmrl.engine.rollout import fast as fast_module
from vlmrl.engine.rollout.fast import FastGeneration, enable_fast_generation, wrap_rollouts

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:  # where the plugins are imported from, as the scripts there run
    sys.path.append(str(ROOT / "benchmarks"))  # last: the scripts beside them shadow nothing

import variants
from variants import rollout
from variants.merge import RolloutMerge, host_bytes, rollout_merge, unsupported_reason

# --- the hook --------------------------------------------------------------------------------------------------


def test_the_registry_is_the_hook_and_the_product_has_none():
    from vlmrl.bench import PATHS, VARIANTS, path_names, vlmrl_engine

    assert VARIANTS == {} and path_names() == PATHS  # the product's bench
    registry: dict = {}
    variants.register(registry)
    assert registry == variants.VARIANTS and not set(registry) & set(PATHS)
    for setup in registry.values():  # each runs where `vlmrl_engine` would, with its arguments
        assert list(inspect.signature(setup).parameters) == list(inspect.signature(vlmrl_engine).parameters)


def test_each_variant_changes_only_its_own_setting():
    """What the bench paths of the config switches that went away run now (their names stay in committed plans)."""
    table, Variant = variants.VARIANTS, variants.Variant
    assert table["vlmrl-stacked"] == table["vlmrl-stacked-kernel"] == table["vlmrl-nf4-v2"] == Variant()  # defaults
    # the nf4 branch experiments and their A/B partner run PEFT's branch over the adapter copies, as when they ran
    assert table["vlmrl-nf4-unfused"] == Variant(stacked=False)
    assert table["vlmrl-4bit-stacked"] == Variant()
    assert not table["vlmrl-nf4-folded"].stacked and not table["vlmrl-nf4-summed"].stacked
    assert table["vlmrl-copies"] == Variant(stacked=False)
    assert table["vlmrl-merged"] == Variant(stacked=False, rollout={"merge": True})
    assert table["vlmrl-filled"] == Variant(rollout={"filled_window": variants.FILLED_WINDOW})
    assert variants.FILLED_WINDOW == 128
    assert table["vlmrl-filled-copies"] == Variant(stacked=False, rollout={"filled_window": 128})
    assert table["vlmrl-input-cast"] == Variant(input_cast=True)
    assert table["vlmrl-own-kernels"] == Variant(loss_pass={"kernels": False})
    options = {name: v.rollout for name, v in table.items() if v.rollout}
    assert options == {
        "vlmrl-merged": {"merge": True}, "vlmrl-filled": {"filled_window": 128},
        "vlmrl-filled-copies": {"filled_window": 128}, "vlmrl-sdpa-decode": {"sdpa_decode": True},
        "vlmrl-guards-once": {"guards_once": True, "graph_trees": True},
        "vlmrl-graph-trees": {"graph_trees": True},
        "vlmrl-second-cublas": {"second_cublas": True},
        "vlmrl-bnb": {"nf4_kernel": "off"}, "vlmrl-nf4-v1": {"nf4_kernel": "v1"},
        "vlmrl-nf4-folded": {"nf4_kernel": "folded"}, "vlmrl-nf4-summed": {"nf4_kernel": "summed"},
        "vlmrl-nf4-by-rule": {"nf4_kernel": "by_rule"}, "vlmrl-nf4-loads": {"nf4_kernel": "loads"},
        "vlmrl-nf4-split-sum": {"nf4_kernel": "split_sum"}, "vlmrl-nf4-bytes": {"nf4_kernel": "bytes"},
        "vlmrl-finished-read": {"finished_read": True},
        "vlmrl-second-inline": {"second_inline": True}, "vlmrl-4bit-stacked-inline": {"second_inline": True},
        "vlmrl-4bit-inline": {"second_inline": True}, "vlmrl-combo-kernels": {"inductor": {"combo_kernels": True}},
        "vlmrl-branch-apart": {"branch_apart": True}, "vlmrl-group-apart": {"group_apart": True}}
    assert table["vlmrl-4bit-inline"].apart and not table["vlmrl-4bit-stacked-inline"].apart
    for keywords in options.values():
        inspect.signature(rollout.apply).bind("trainer", "fast", **keywords)  # apply takes these keywords


@pytest.mark.parametrize("name", ["merge", "rollout", "nf4_v1", "nf4_lora", "nf4_launch", "nf4_pairs", "nf4_lookups",
                                  "nf4_bytes", "nf4_loads", "second_inline", "stacked_4bit"])
def test_each_plugin_module_imports(name):
    importlib.import_module(f"variants.{name}")


@pytest.fixture
def stub_loss_pass(monkeypatch):
    """`enable_loss_pass` recording its options (a fake trainer has no loss pass to change)."""
    from vlmrl.engine.loss import loss_pass

    monkeypatch.setattr(loss_pass, "enable_loss_pass", lambda trainer, **options: loss_pass.LossPass(
        None, loss_pass.LengthGrouping(False, why_not="a stub"), kernels=str(options)))


def _block_trainer(seen: list | None = None):
    model = lora_policy(Block().to(torch.bfloat16))  # float32 adapters over a bf16 base
    return model, fake_trainer(model, lambda: None if seen is None else seen.append(
        [layer.merged for layer in lora_layers(model)]))


def test_a_variant_sets_up_the_engine_from_outside(stub_loss_pass):
    from vlmrl.bench import BenchSettings
    from vlmrl.engine.rollout import stacked

    product = stacked.StackedProjections
    _, trainer = _block_trainer()
    fast, loss = variants.VARIANTS["vlmrl-copies"](trainer, BenchSettings())
    assert fast.adapters.startswith("not stacked (turned off by a bench variant); bfloat16 copies made per rollout")
    assert [name for name, _ in trainer.vlmrl_rollout_contexts if name in ("offload", "adapter_copies", "stacked")] \
        == ["offload", "adapter_copies"]
    assert stacked.StackedProjections is product and loss.kernels == "{}"  # the product's class again after it
    _, trainer = _block_trainer()
    fast, loss = variants.VARIANTS["vlmrl-own-kernels"](trainer, BenchSettings())
    assert fast.adapters.startswith("stacked by shared input") and loss.kernels == "{'kernels': False}"
    model, trainer = _block_trainer()
    _, loss = variants.VARIANTS["vlmrl-input-cast"](trainer, BenchSettings())
    assert loss.adapter_inputs == "cast to float32 by PEFT (a bench variant)"
    assert all(layer.cast_input_dtype_enabled is True for layer in lora_layers(model))


def test_the_merged_path_drops_the_copies_and_restores_the_weights(stub_loss_pass):
    from vlmrl.bench import BenchSettings

    seen: list = []
    model, trainer = _block_trainer(seen)
    before = [layer.get_base_layer().weight.clone() for layer in lora_layers(model)]
    fast, _ = variants.VARIANTS["vlmrl-merged"](trainer, BenchSettings())
    assert isinstance(fast, rollout.VariantRecord) and fast.merge.startswith("merged for rollouts")
    assert fast.adapters == "merged into the base weights (stacked projections and copies unused)"
    names = [name for name, _ in trainer.vlmrl_rollout_contexts]
    assert "merge" in names and not {"offload", "adapter_copies", "stacked"} & set(names)
    assert fast.as_dict()["merge"] == fast.merge and fast.as_dict()["guards"] is None
    assert set(fast.as_dict()) - set(FastGeneration(True, "").as_dict()) == {"merge", "guards"}
    trainer._generate_single_turn()
    assert seen == [[True] * len(before)]  # merged inside the rollout
    after = [layer.get_base_layer().weight for layer in lora_layers(model)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))  # restored bit for bit


def test_the_kernel_variants_take_the_products_pieces_out_again():
    _, cublas = _block_trainer()  # the bench's vlmrl-second-cublas
    fast = rollout.apply(cublas, enable_fast_generation(cublas), second_cublas=True)
    assert "second_factors" not in fast.adapters
    assert dict(cublas.vlmrl_rollout_contexts)["stacked"].keywords == {"fused": False, "first_factors": None}
    _, sdpa = _block_trainer()  # vlmrl-sdpa-decode: no decode kernel to take out here (no vlmrl_sdpa)
    fast = rollout.apply(sdpa, enable_fast_generation(sdpa), sdpa_decode=True)
    assert fast.cache_read == "the whole static cache (the decode kernel needs vlmrl_sdpa)"
    assert "decode_kernel" not in dict(sdpa.vlmrl_rollout_contexts)
    _, apart = _block_trainer()  # vlmrl-group-apart: cuBLAS's matmul, then the second-step kernel
    fast = rollout.apply(apart, enable_fast_generation(apart), group_apart=True)
    assert "group_step" not in fast.adapters and fast.adapters.endswith("its second step one Triton kernel (a bench "
                                                                        "variant)")
    from vlmrl.engine.rollout import group_step

    with dict(apart.vlmrl_rollout_contexts)["group_apart"]():
        assert not group_step.usable(torch.zeros(2, 128, dtype=torch.bfloat16), None, None, None)
    assert group_step.usable.__name__ == "usable"  # the product's again after the block


def test_the_finished_read_variant_lets_ended_rows_read_their_whole_cache():
    from vlmrl.engine.rollout.fast import KERNEL_READ

    names = ("attention", "decode_kernel", "finished_rows", "stop_check")
    trainer = SimpleNamespace(model=None, _generate_single_turn=lambda: None)
    wrap_rollouts(trainer, [(name, contextlib.nullcontext) for name in names])
    fast = FastGeneration(True, "", cache_read="the whole static cache" + KERNEL_READ)
    record = rollout.apply(trainer, fast, finished_read=True)
    assert [name for name, _ in trainer.vlmrl_rollout_contexts] == ["attention", "decode_kernel", "stop_check"]
    assert record.cache_read == ("the whole static cache; token steps skip the blocks nothing attends to "
                                 "(vlmrl.engine.rollout.decode_attention), rows that have ended reading all of theirs (a bench variant)")
    wrap_rollouts(trainer, [(name, contextlib.nullcontext) for name in names])
    rollout.apply(trainer, fast, sdpa_decode=True)  # no decode kernel: nothing to narrow for
    assert [name for name, _ in trainer.vlmrl_rollout_contexts] == ["attention", "stop_check"]


def _named_trainer(model, seen: list) -> SimpleNamespace:
    """A trainer as `enable_fast_generation` leaves it: named rollout contexts that record when they are entered."""
    trainer = SimpleNamespace(model=model, _generate_single_turn=lambda: seen.append(
        ("rollout", all(layer.merged for layer in lora_layers(model)))))

    @contextlib.contextmanager
    def context(name):
        seen.append(name)
        yield

    names = ("attention", "decode_kernel", "offload", "stacked", "autocast", "stop_check", "compile_over_4bit")
    wrap_rollouts(trainer, [(name, functools.partial(context, name)) for name in names])
    return trainer


def test_apply_puts_each_variant_in_its_place_and_records_it():
    seen: list = []
    model = lora_net(torch.bfloat16)
    before = [layer.get_base_layer().weight.clone() for layer in lora_layers(model)]
    trainer = _named_trainer(model, seen)
    fast = FastGeneration(True, "static KV cache + torch.compile", cache_read="the whole static cache",
                          adapters="stacked by shared input")
    done = rollout.apply(trainer, fast, merge=True, filled_window=64, guards_once=True)
    assert [name for name, _ in trainer.vlmrl_rollout_contexts] == [
        "attention", "filled_window", "decode_kernel", "merge", "autocast", "stop_check", "guards_once",
        "compile_over_4bit"]  # the stacked projections and the state's offload serve the unmerged adapter only
    assert done.merge.startswith("merged for rollouts") and done.guards == "first step"
    assert done.cache_read == "filled positions, rounded up to 64" and done.adapters.startswith("merged")
    seen.clear()
    trainer.vlmrl_rollout_contexts = [c for c in trainer.vlmrl_rollout_contexts
                                      if c[0] not in ("filled_window", "guards_once")]  # need a real model
    wrap_rollouts(trainer, trainer.vlmrl_rollout_contexts)
    trainer._generate_single_turn()
    assert seen == ["attention", "decode_kernel", "autocast", "stop_check", "compile_over_4bit", ("rollout", True)]
    after = [layer.get_base_layer().weight for layer in lora_layers(model)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))  # restored bit for bit
    off = FastGeneration(False, "vLLM")
    assert rollout.apply(trainer, off, merge=True) is off


def test_inductor_settings_and_the_pointwise_second_step_hold_while_rollouts_run():
    import torch._inductor.config as inductor_config

    from vlmrl.engine.rollout import stacked

    model = lora_net(torch.bfloat16)
    product_compute = stacked._Group.compute
    seen: list = []
    trainer = _named_trainer(model, seen)
    fast = FastGeneration(True, "static KV cache + torch.compile", mode="reduce-overhead", adapters=(
        "stacked by shared input" + rollout.SECOND_KERNEL))
    done = rollout.apply(trainer, fast, second_inline=True, inductor={"combo_kernels": True})
    assert done.mode == "reduce-overhead, inductor {'combo_kernels': True} (a bench variant)"
    assert done.adapters.endswith("each group's second step as pointwise products (a bench variant)")
    during = []
    wrap_rollouts(trainer, [*trainer.vlmrl_rollout_contexts, ("probe", lambda: contextlib.nullcontext(
        during.append((inductor_config.combo_kernels, stacked._Group.compute is not product_compute))))])
    trainer._generate_single_turn()
    assert during == [(True, True)]
    assert inductor_config.combo_kernels is False and stacked._Group.compute is product_compute


def test_the_graph_trees_variant_takes_the_recorded_step_out_again():
    from transformers import CompileConfig

    seen: list = []
    trainer = _named_trainer(lora_net(torch.bfloat16), seen)
    contexts = trainer.vlmrl_rollout_contexts
    wrap_rollouts(trainer, [*contexts[:-1], ("step_graph", contextlib.nullcontext), contexts[-1]])
    trainer.generation_config = SimpleNamespace(compile_config=CompileConfig(mode="default"))
    done = rollout.apply(trainer, FastGeneration(True, "", mode="default", step_graph="recorded"), graph_trees=True)
    assert "step_graph" not in [name for name, _ in trainer.vlmrl_rollout_contexts]
    assert trainer.generation_config.compile_config.mode == done.mode == "reduce-overhead"
    assert done.step_graph == "CUDA graph trees (a bench variant)"


# --- the merged rollout (merge.py) -----------------------------------------------------------------------------


def _base_weights(model) -> list[torch.Tensor]:
    return [layer.get_base_layer().weight.detach().clone() for layer in lora_layers(model)]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_merged_weights_compute_the_adapters_output(dtype, tolerance):
    model = lora_net(dtype)
    x = torch.randn(5, 64, dtype=dtype)
    with torch.no_grad():
        expected = model(x)
        merge = RolloutMerge(model)
        with merge.merged():
            assert all(layer.merged for layer in lora_layers(model))  # peft's forward skips the LoRA branch
            got = model(x)
        assert not any(layer.merged for layer in lora_layers(model))
        again = model(x)
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


def test_bf16_base_weights_come_back_exactly_where_peft_unmerge_drifts():
    model = lora_net(torch.bfloat16)
    before = _base_weights(model)
    merge = RolloutMerge(model)
    for _ in range(3):
        with merge.merged():
            assert not all(torch.equal(w, b) for w, b in zip(merge.weights, before))  # really merged
    assert all(torch.equal(w, b) for w, b in zip(merge.weights, before))
    # control: what a merge/unmerge round trip (peft, TRL's vLLM sync) does to the same bf16 weights
    for _ in range(3):
        model.merge_adapter()
        model.unmerge_adapter()
    assert not all(torch.equal(w, b) for w, b in zip(merge.weights, before))


def test_an_error_or_a_peft_unmerge_inside_the_rollout_still_restores_the_weights():
    model = lora_net(torch.bfloat16)
    before = _base_weights(model)
    merge = RolloutMerge(model)
    with pytest.raises(RuntimeError, match="boom"), merge.merged():
        raise RuntimeError("boom")
    assert all(torch.equal(w, b) for w, b in zip(merge.weights, before))
    with merge.merged():
        model.unmerge_adapter()  # e.g. peft's disable_adapter path: subtracts the delta, clears merged_adapters
    assert all(torch.equal(w, b) for w, b in zip(merge.weights, before))
    assert not any(layer.merged for layer in lora_layers(model))


def test_merged_bf16_weights_keep_large_deltas_and_lose_small_ones():
    """Why merging lost: bf16 rounding of W + D drops the elements of D below half a bf16 step of W."""
    torch.manual_seed(0)
    weight = (torch.randn(256, 256) * 0.02).to(torch.bfloat16)
    x = torch.randn(64, 256)

    def lost_share(scale: float) -> float:
        delta = torch.randn(256, 256) * scale
        merged = (weight.float() + delta).to(torch.bfloat16).float() - weight.float()
        return float((x @ (merged - delta).T).norm() / (x @ delta.T).norm())

    assert lost_share(1e-5) > 0.5  # most of an early-training adapter's effect is gone from the rollout policy
    assert lost_share(1e-2) < 0.05  # a large delta survives the rounding


def test_host_copy_size_what_is_not_merged_and_why(monkeypatch):
    from variants import merge

    model = lora_net(torch.bfloat16)
    need = host_bytes(model)
    assert need == 2 * (64 * 256 + 256 * 64) and unsupported_reason(model) is None
    assert unsupported_reason(Net()) == "no LoRA layers"
    assert "DoRA" in unsupported_reason(lora_net(torch.float32, use_dora=True))
    assert "lora_bias" in unsupported_reason(lora_net(torch.float32, lora_bias=True))
    with pytest.raises(ValueError, match="cannot merge the adapter for rollouts: no LoRA layers"):
        RolloutMerge(Net())
    merger, note = rollout_merge(SimpleNamespace(model=model))
    assert isinstance(merger, RolloutMerge) and note.startswith("merged for rollouts")
    assert merger._originals is not None  # the host copy is made up front, before any rollout
    _, note = rollout_merge(SimpleNamespace(model=model, is_fsdp_enabled=True))
    assert note == "not merged: parameters are sharded (FSDP / DeepSpeed)"
    monkeypatch.setattr(merge, "available_host_bytes", lambda: 4 * need)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four processes on this host, each pinning a copy
    merger, note = rollout_merge(SimpleNamespace(model=model))
    assert merger is None and note.startswith("not merged: 4 pinned copies of")


# --- the filled-cache window (rollout.attend_filled) -----------------------------------------------------------


def test_reading_the_filled_positions_only_is_the_same_attention():
    torch.manual_seed(0)
    batch, kv_heads, cache, filled, dim = 3, 2, 24, 13, 8
    query = torch.randn(batch, kv_heads * 4, 1, dim, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, cache, dim, dtype=torch.float64)
    value = torch.randn(batch, kv_heads, cache, dim, dtype=torch.float64)
    mask = torch.zeros(batch, 1, 1, cache, dtype=torch.bool)
    mask[:, :, :, :filled] = True
    mask[1, :, :, :2] = False  # left padding
    full, _ = attention.packed_gqa_sdpa(AttentionModule(4), query, key, value, mask)
    sdpa = functools.partial(rollout.filled_sdpa, attention.packed_gqa_sdpa)
    for window in (filled, 16, cache):
        part, _ = sdpa(AttentionModule(4), query, key, value, mask,
                       **{rollout.FILLED: torch.empty(window, dtype=torch.uint8)})
        torch.testing.assert_close(part, full)
    # what the positions past the window hold does not matter: they are not read
    key[:, :, 16:] = value[:, :, 16:] = float("nan")
    part, _ = sdpa(AttentionModule(4), query, key, value, mask, **{rollout.FILLED: torch.empty(16, dtype=torch.uint8)})
    torch.testing.assert_close(part, full)


def test_without_a_whole_cache_mask_nothing_is_dropped():
    key = value = torch.randn(1, 2, 10, 4)
    filled = torch.empty(4, dtype=torch.uint8)
    assert rollout.attend_filled_only(key, value, None, filled)[0].shape[2] == 10  # nothing hides the rest
    short_mask = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    assert rollout.attend_filled_only(key, value, short_mask, filled)[0].shape[2] == 10
    k, v, m = rollout.attend_filled_only(key, value, torch.ones(1, 1, 1, 10, dtype=torch.bool), filled)
    assert k.shape[2] == v.shape[2] == m.shape[-1] == 4


def test_the_window_wraps_vlmrl_sdpa_only_while_active():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention.register()
    product = ALL_ATTENTION_FUNCTIONS[attention.NAME]
    model = SimpleNamespace(prepare_inputs_for_generation=lambda ids, **kw: {"input_ids": ids})
    with rollout.attend_filled(model, 8):
        wrapped = ALL_ATTENTION_FUNCTIONS[attention.NAME]
        assert wrapped.func is rollout.filled_sdpa and wrapped.args == (product,)
        ids = torch.zeros(1, 3)
        assert model.prepare_inputs_for_generation(ids) == {"input_ids": ids}  # no static cache: nothing to add
    assert ALL_ATTENTION_FUNCTIONS[attention.NAME] is product


def test_a_variant_path_is_reported_beside_the_others():
    """A variant path (registered by a plugin, not one of `PATHS`) gets its ratios and its record's settings."""
    from vlmrl.bench import PATHS, BenchSettings, load_shapes, markdown_table, summarize

    assert "vlmrl-filled" not in PATHS

    def raw(path, seconds, fast=None):
        return {"path": path, "error": None, "fast_generation": fast, "peak_memory_gib": 20.0,
                "peak_reserved_gib": 21.0, "steps": [{"seconds": s, "generate_seconds": s - 5} for s in seconds]}

    results = [raw("plain", [100, 100]), raw("vlmrl", [60, 20], {"enabled": True, "cache_read": "the whole static cache"}),
               raw("vlmrl-filled", [60, 18], {"enabled": True, "cache_read": "filled positions, rounded up to 128",
                                              "guards": "first step"})]
    summary = summarize(BenchSettings(paths=["plain", "vlmrl", "vlmrl-filled"]), load_shapes("qwen3_vl_8b"),
                        {"matmul_tflops": 800, "copy_bandwidth_tbs": 4.0}, results, prompt_tokens=310)
    assert summary["ratios"]["filled_step_speedup"] == pytest.approx(100 / 18)
    table = markdown_table(summary)
    assert "vlmrl-filled: attention reads filled positions, rounded up to 128, guards checked: first step." in table
    assert "vlmrl: attention reads the whole static cache." in table


# --- the nf4 variants' records (rollout.apply(nf4_kernel=...)) -------------------------------------------------


@pytest.mark.parametrize(("variant", "record", "given", "routed"), [
    ("off", "bitsandbytes Linear4bit (vlmrl's nf4 kernel turned off by a bench variant)", [], False),
    ("v1", "vlmrl nf4 kernel v1 (a bench variant) for token steps of 2-64 rows, bitsandbytes Linear4bit otherwise",
     [], True),
    ("by_rule", ("vlmrl nf4 kernel with its settings by rule, not TUNED_SM90 (a bench variant) for token steps of "
                 "2-64 rows, bitsandbytes Linear4bit otherwise"), [True], True),  # the product's, settings given
    ("loads", ("vlmrl nf4 kernel with its table lookups as loads, not warp shuffles (a bench variant) for token steps "
               "of 2-64 rows, bitsandbytes Linear4bit otherwise"), [], True),  # the plugin's launch of its kernel
    ("split_sum", ("vlmrl nf4 kernel with its K splits summed by a second kernel (a bench variant) for token steps "
                   "of 2-64 rows, bitsandbytes Linear4bit otherwise"), [], True),
    ("bytes", ("vlmrl nf4 kernel decoding a byte at a time, as before it read words, its K splits summed by a second "
               "kernel (a bench variant) for token steps of 2-64 rows, bitsandbytes Linear4bit otherwise"), [], True),
])
def test_the_nf4_variants_swap_the_products_kernel(variant, record, given, routed, launches, monkeypatch):
    pytest.importorskip("bitsandbytes")
    from variants import nf4_launch

    from tests.helpers import NF4_DEVICE, nf4_layer, nf4_model, nf4_rollout_trainer
    from vlmrl.engine.rollout import nf4

    if not nf4.HAS_TRITON or not (torch.cuda.is_available() or nf4.interpreted()):
        pytest.skip("needs Triton on CUDA or its interpreter (tests/conftest.py)")
    monkeypatch.setattr(nf4, "gpu_reason", lambda device: None)
    settings = []  # per launch of the product's kernel: whether its settings were given
    real = nf4.launch
    monkeypatch.setattr(nf4, "launch", lambda *a, **kw: settings.append(bool(a[11])) or real(*a, **kw))
    first = []  # launches of the first design (the plugin's own launch)
    real_v1 = nf4_launch.launch
    monkeypatch.setattr(nf4_launch, "launch", lambda *a, **kw: first.append(a[0].shape[0]) or real_v1(*a, **kw))
    model = nf4_model(nf4_layer(256, 192))
    trainer = nf4_rollout_trainer(model, torch.randn(4, 1, 256).to(NF4_DEVICE, torch.bfloat16))
    fast = rollout.apply(trainer, enable_fast_generation(trainer), nf4_kernel=variant)
    assert fast.weights == record
    trainer._generate_single_turn()
    assert settings == [False, *given]  # the probe (the product's), then the rollout's token step
    assert first == ([4] if variant in ("v1", "loads", "split_sum", "bytes") else [])
    assert ("forward" in model[0].__dict__) is routed
    if trainer.vlmrl_nf4_decode is not None:  # (closed by the "off" variant)
        trainer.vlmrl_nf4_decode.close()
    assert "forward" not in model[0].__dict__


def test_the_lookup_designs_launch_the_products_kernel_with_shuffles_off_or_forced_on():
    """nf4_lookups: "loads" is the product's tile kernel with `SHUFFLE` off, "shuffle" with it on (compiled only: the
    interpreter runs no PTX), both summing a split K in a second kernel; "pairs" a kernel of its own."""
    pytest.importorskip("triton")
    from variants import nf4_lookups

    from vlmrl.engine.rollout import nf4_triton

    product = nf4_triton.kernels(False)[0]
    loads, shuffle = nf4_lookups.tiles("loads")(False), nf4_lookups.tiles("shuffle")(False)
    two_kernels = {"Final": None, "Counters": None, "SPLITS": 0}  # a split K summed by the second kernel
    assert loads.kernel is product and loads.settings == {"SHUFFLE": False} | two_kernels
    assert shuffle.kernel is product and shuffle.settings == {"SHUFFLE": True} | two_kernels
    assert nf4_lookups.tiles("shuffle")(True).settings == {"SHUFFLE": False} | two_kernels
    pairs, bytes_ = nf4_lookups.tiles("pairs"), nf4_lookups.tiles("bytes")
    assert pairs(False).kernel is bytes_(False).kernel is nf4_lookups.byte_loop(False) is not product
    assert pairs(False).settings == {"SHUFFLE": False, "PAIRS": True}
    assert bytes_(False).settings == {"SHUFFLE": True, "PAIRS": False}
    assert bytes_(True).settings == {"SHUFFLE": False, "PAIRS": False}


@pytest.mark.parametrize("design", ["pairs", "bytes"])
@pytest.mark.parametrize(("rows", "k", "config", "nested"), [
    (5, 320, [16, 64, 4, 1, 2], True),  # K split, the second split a partial tile
    (3, 256, [32, 32, 4, 1, 1], False),  # no split: bias and rounding in the tile kernel
    (17, 512, [16, 64, 4, 1, 1], True),  # a second block of rows, two steps of the loop
])
def test_the_byte_loops_give_the_products_values_bit_for_bit(design, rows, k, config, nested):
    """The byte loop before the words ("bytes") and one lookup a byte in the pair table ("pairs") decode the same
    float32 table values into the same weights, summed in the same order as the product's word loop (each word's 8
    nibbles in the row's order, the word's block scale), so the same bits (Triton's interpreter, where the lookups
    are loads)."""
    from variants import nf4_bytes, nf4_launch, nf4_pairs

    from tests.helpers import nf4_quantized
    from vlmrl.engine.rollout import nf4

    if not nf4.HAS_TRITON or not nf4.interpreted():
        pytest.skip("needs Triton's interpreter (tests/conftest.py)")
    packed, qs = nf4_quantized(96, k, nested=nested, seed=3)
    x = torch.randn(rows, k).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16)
    matmul = nf4_pairs.nf4_matmul_pairs if design == "pairs" else nf4_bytes.nf4_matmul_bytes
    got = matmul(x, packed, bias, quant_state=qs, config=config)
    assert nf4_launch.failure(x, design) is None  # the kernel ran, not dequantize + matmul
    assert torch.equal(got, nf4.nf4_matmul(x, packed, bias, quant_state=qs, config=config))


def test_the_pair_table_holds_the_tables_values():
    from variants import nf4_pairs

    from tests.helpers import nf4_quantized

    _, qs = nf4_quantized(96, 256, seed=3)
    table = nf4_pairs.pair_table(qs.code)
    assert torch.equal(table[:16], qs.code.float())
    assert torch.equal(table[16:].view(256, 2)[0x7A], torch.stack([qs.code[7], qs.code[10]]).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_loop_before_the_words_gives_the_products_values_on_a_gpu():
    """Compiled, the product looks its nibbles up by warp shuffle from the shifted word (the bit above the nibble
    picks the lane's twin): the same bits as the byte loop before it at Qwen3-VL-8B's shapes and the token step's
    rows."""
    pytest.importorskip("bitsandbytes")
    from variants import nf4_bytes, nf4_launch

    from tests.helpers import nf4_quantized
    from vlmrl.engine.rollout import nf4

    for n, k in ((4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288)):
        packed, qs = nf4_quantized(n, k, seed=n + k)
        for rows in (16, 32):
            x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
            got = nf4_bytes.nf4_matmul_bytes(x, packed, quant_state=qs)
            assert nf4_launch.failure(x, "bytes") is None
            assert torch.equal(got, nf4.nf4_matmul(x, packed, quant_state=qs)), (n, k, rows)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_vlmrl_copies_keeps_peft_s_branch_over_a_4bit_base_where_the_product_stacks_the_first_factors(monkeypatch):
    from vlmrl.engine.rollout import nf4, step_graph

    monkeypatch.setattr(nf4, "gpu_reason", lambda device: None)
    unrecorded = enable_fast_generation(fake_trainer(nf4_block(), lambda: None))  # weights on the CPU: no graphs
    assert unrecorded.step_graph.startswith("CUDA graph trees (weights on cpu")
    assert unrecorded.adapters.startswith("not stacked (a Linear4bit base layer (its first factors are stacked only "
                                          "where token steps are recorded)")
    monkeypatch.setattr(step_graph, "cuda_reason", lambda model: None)  # token steps recorded, as on an H100
    product = enable_fast_generation(fake_trainer(nf4_block(), lambda: None))
    assert product.adapters.startswith("stacked by shared input for rollouts (3 groups of 3/2/1 projections, over "
                                       "the 4-bit base their first factors only")
    assert product.adapters.endswith(fast_module.BRANCH_KERNEL)  # each member and its branch one nf4 launch
    apart_trainer = fake_trainer(nf4_block(), lambda: None)
    apart = rollout.apply(apart_trainer, enable_fast_generation(apart_trainer), branch_apart=True)
    assert apart.adapters.endswith(fast_module.SECOND_KERNEL + ", apart from each projection's nf4 kernel (a bench "
                                   "variant)")
    names = [name for name, _ in apart_trainer.vlmrl_rollout_contexts]
    assert names.index("branch_apart") < names.index("stacked")  # in place before the groups are loaded
    product.graphs._failed("a capture error")  # back to the graph trees: PEFT's own branch from the next rollout
    assert product.as_dict()["adapters"].endswith("; PEFT's own branch over the 4-bit base with the graph trees")
    trainer = fake_trainer(nf4_block(), lambda: None)
    with rollout.unstacked():  # what the path `vlmrl-copies` sets the engine up inside
        fast = enable_fast_generation(trainer)
    assert fast.adapters.startswith("not stacked (turned off by a bench variant)")
    assert "stacked" not in [name for name, _ in trainer.vlmrl_rollout_contexts]  # PEFT's own forwards


def test_the_second_step_as_pointwise_products_computes_the_stacked_groups_outputs():
    """`vlmrl-second-inline`: a block's stacked groups give the product's unfused values (to bf16 rounding: the
    product's sum runs in another order), with per-member scales, and compile to no second-step op nor matmul."""
    from variants import second_inline

    from tests.helpers import compiled_calls
    from vlmrl.engine.rollout.stacked import StackedProjections

    block = lora_policy(Block(64).to(torch.bfloat16), rank_pattern={"k_proj": 2}, alpha_pattern={"v_proj": 2})
    torch.manual_seed(3)
    x, y = torch.randn(4, 5, 64, dtype=torch.bfloat16), torch.randn(4, 5, 64, dtype=torch.bfloat16)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    stack = StackedProjections(block)
    with torch.no_grad(), autocast, stack.active():
        expected = block(x, y)
    for compiled in (False, True):
        with torch.no_grad(), autocast, stack.active(fused=True), second_inline.second_inline():
            assert any(isinstance(g.scale, torch.Tensor) for g in stack.groups)  # v's alpha: one scale a column
            got, nodes = compiled_calls(block, x, y) if compiled else (block(x, y), [])
        for a, b in zip(got, expected, strict=True):
            assert a.dtype == torch.bfloat16
            torch.testing.assert_close(a, b, rtol=8e-3, atol=1e-2)
    assert not any("stacked_second" in n for n in nodes)
    # only the stacked first matmuls: q/k/v for x, for y and for x again, gate/up for y and x, o for x
    assert nodes.count("<built-in function linear>") == 6
    assert stack.groups[0].compute.__func__ is not second_inline._stacked_compute  # the product's again
    with torch.no_grad():
        base, first = torch.randn(3, 8), torch.randn(3, 4)
        second = torch.randn(8, 4)
        torch.testing.assert_close(second_inline.inline_added(base, first, second, 0.5),
                                   base + 0.5 * (first @ second.T))


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_over_a_4bit_base_the_pointwise_second_step_keeps_peft_s_first_factors_apart():
    """`vlmrl-4bit-inline`: one group a projection (PEFT's first factors as the product runs them), the second step
    pointwise; the product's values to bf16 rounding."""
    from variants import second_inline, stacked_4bit

    from tests.helpers import nf4_block_with_expected
    from vlmrl.engine.rollout import nf4

    block, x, y, autocast, expected = nf4_block_with_expected()
    with stacked_4bit.first_factors_apart():
        stack = stacked_4bit.stacked.StackedProjections(block, first_factors=True)  # as enable_fast_generation builds
    assert stack.reason is None and [len(g.layers) for g in stack.groups] == [1] * 6
    assert stacked_4bit.stacked.SHARED_INPUT  # the product's grouping again after the block
    with torch.no_grad(), autocast, nf4.nf4_decode(block), stack.active(fused=True), second_inline.second_inline():
        got = block(x, y)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=8e-3, atol=1e-2)
