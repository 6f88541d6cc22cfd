"""The nf4 token-step kernel (the product's `vlmrl.engine.rollout.nf4.nf4_matmul`, "v2"; its first design is a
bench plugin, benchmarks/variants/nf4_v1.py, which only benchmarks run) against bitsandbytes'
dequantize-then-matmul: within one bf16/fp16 unit per output, in Triton's CPU interpreter (tests/conftest.py turns
it on) on small shapes, and on a CUDA GPU at Qwen3-VL-8B's shapes; `nf4_decode` routing token steps only, the fast
path turning it on where it applies, and the recorded fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import compiled_calls, nf4_layer, nf4_model, nf4_quantized, nf4_rollout_trainer, nf4_units
from vlmrl.engine.rollout import arrivals, nf4, nf4_settings

bnb = pytest.importorskip("bitsandbytes")
BF = bnb.functional
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not nf4.HAS_TRITON or not (DEVICE == "cuda" or nf4.interpreted()),
                                reason="needs Triton on CUDA or its interpreter (tests/conftest.py)")
KERNELS = pytest.mark.parametrize("matmul", [nf4.nf4_matmul], ids=["v2"])


@pytest.fixture(autouse=True)
def _nf4_launches(launches):
    """Every test here records the kernel's launches (tests/conftest.py's `launches`)."""
    return launches


def _check(got, x, packed, qs, bias=None, min_equal=0.95):
    """`got` within one unit of bitsandbytes' dequantize-then-matmul (what `MatMul4Bit` computes with gradients on)."""
    weight = BF.dequantize_4bit(packed, qs).to(x.dtype)
    expected = F.linear(x, weight, bias)
    scale = x.float().abs() @ weight.float().abs().T + (0 if bias is None else bias.float().abs())
    assert got.dtype == expected.dtype and got.shape == expected.shape
    units = nf4_units(got, expected, scale)
    assert units.max() <= 1, f"{float(units.max()):.2f} units apart"
    assert (got == expected).float().mean() >= min_equal  # rounded where bitsandbytes rounds: off by summation order only


@pytest.mark.slow  # ~7 s in all: K up to 12288 in the interpreter
@pytest.mark.parametrize("k", [4096, 12288])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_at_the_8b_shapes_depth_it_rounds_the_exact_product(dtype, k):
    """Qwen3-VL-8B's K (4096 for q/k/v/o/gate/up, 12288 for down), 32 rows: each output within 0.6 of a unit of the
    exact product of the same rounded weights (float64 sums), so as good as the correctly rounded result, in fp16
    too. On an H200 the fp16 kernel was 2 units from cuBLAS's dequantize + matmul (benchmarks/NOTES.md);
    benchmarks/nf4_matmul.py gives each side's distance from the exact product there."""
    packed, qs = nf4_quantized(64, k, weight_dtype=dtype)
    x = torch.randn(32, k).to(DEVICE, dtype)
    weight = BF.dequantize_4bit(packed, qs).to(dtype)
    got = nf4.nf4_matmul(x, packed, quant_state=qs)
    exact = F.linear(x.double(), weight.double())
    scale = x.float().abs() @ weight.float().abs().T
    units = nf4_units(got, exact, scale)
    assert got.dtype == dtype and units.max() <= 0.6, f"{float(units.max()):.2f} units from the exact product"
    assert not nf4._failed


@KERNELS
@pytest.mark.parametrize(("rows", "bias"), [(1, False), (5, True), (16, False), (16, True), (33, True)])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_it_is_bitsandbytes_dequantize_then_matmul(dtype, nested, rows, bias, matmul, launches):
    # double quantisation, blocksize 64: the loader's; K split in two (the interpreter's default)
    packed, qs = nf4_quantized(192, 256, weight_dtype=dtype, nested=nested)
    x = torch.randn(rows, 256).to(DEVICE, dtype)
    b = torch.randn(192).to(DEVICE, dtype) if bias else None
    got = matmul(x, packed, b, quant_state=qs)
    _check(got, x, packed, qs, b)
    assert launches == [rows] and not nf4._failed


def _exact_weights(n, k, dtype, weight_dtype=torch.bfloat16, config=None, matmul=nf4.nf4_matmul, nested=True):
    # x = the identity: row j of the output is column j of W, one product per sum, so nothing but the
    # dequantization can differ from bitsandbytes'
    packed, qs = nf4_quantized(n, k, weight_dtype=weight_dtype, nested=nested, seed=4)
    got = matmul(torch.eye(k, device=DEVICE, dtype=dtype), packed, quant_state=qs, config=config)
    assert torch.equal(got, BF.dequantize_4bit(packed, qs).to(dtype).T)


@KERNELS
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_weight_is_dequantized_exactly_as_bitsandbytes_does(dtype, nested, matmul):
    _exact_weights(64, 256, dtype, config=[64, 128, 4, 1, 1], matmul=matmul, nested=nested)


@KERNELS
@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.float32])
def test_the_compiled_kernels_branch_in_fp16(weight_dtype, matmul, monkeypatch):
    # what a GPU runs (conversions in hardware, the dot in the inputs' dtype), here where the interpreter converts
    # as a GPU does: fp16 (it truncates to bf16, hence the bit-level branch the other tests run)
    monkeypatch.setattr(nf4, "interpreted", lambda: False)
    _exact_weights(64, 256, torch.float16, weight_dtype=weight_dtype, config=[32, 64, 4, 1, 1], matmul=matmul)
    packed, qs = nf4_quantized(64, 256, weight_dtype=weight_dtype, seed=5)
    x, bias = torch.randn(5, 256).to(DEVICE, torch.float16), torch.randn(64).to(DEVICE, torch.float16)
    _check(matmul(x, packed, bias, quant_state=qs, config=[32, 64, 4, 1, 2]), x, packed, qs, bias)


@KERNELS
@pytest.mark.parametrize(("rows", "k", "config"), [
    (3, 256, [32, 32, 4, 1, 1]),  # no split: bias and rounding in the tile kernel
    (3, 256, [64, 64, 4, 1, 3]),  # 2 blocks per tile, more splits than tiles asked for
    (70, 256, [16, 32, 4, 1, 4]),  # two blocks of rows (a prompt pass called directly)
    (3, 192, [32, 64, 4, 1, 1]),  # 96 packed bytes a row: the last tile of 64 half full
    (5, 320, [16, 64, 4, 1, 2]),  # 160 bytes: splits of 128 and 32, the second a partial tile
    (32, 512, [128, 64, 4, 1, 6]),  # TUNED_SM90's kinds of settings: more outputs than N, splits of a tile each
    (16, 512, [64, 128, 4, 1, 64]),  # 256-weight steps, more splits asked for than there are
])
def test_tiles_and_splits_give_the_same_values(rows, k, config, matmul):
    packed, qs = nf4_quantized(96, k, seed=1)
    x = torch.randn(2, rows, k).to(DEVICE, torch.bfloat16)  # leading dims kept
    bias = torch.randn(96).to(DEVICE, torch.bfloat16)
    got = matmul(x, packed, bias, quant_state=qs, config=config)
    assert got.shape == (2, rows, 96)
    _check(got, x, packed, qs, bias)


@pytest.mark.parametrize("split", [2, 6, 64, 100])  # 100: more splits than a program's loads in flight at 128 outputs
@pytest.mark.parametrize("bias", [False, True])
def test_the_split_sum_adds_the_shares_in_order_and_rounds_once(split, bias):
    target = torch.randn(split, 3, 200, generator=torch.Generator().manual_seed(split)).to(DEVICE) * 1e3
    b = torch.randn(200).to(DEVICE, torch.bfloat16) if bias else None
    out = torch.empty(3, 200, device=DEVICE, dtype=torch.bfloat16)
    nf4.sum_splits(target, b, out, 1, nf4.interpreted())
    expected = torch.zeros(3, 200, device=DEVICE)
    for share in target:  # float32, split 0 first: the order the tile kernel's splits were always summed in
        expected += share
    if b is not None:
        expected += b.float()
    assert torch.equal(out, expected.to(torch.bfloat16))  # bit for bit: rounded once, ties to even


@KERNELS
@pytest.mark.parametrize(("rows", "k", "config"), [
    (3, 256, [64, 64, 4, 1, 3]),  # 2 splits (of 3 asked), one tile
    (5, 320, [16, 64, 4, 1, 2]),  # a partial last split, 6 tiles
    (70, 256, [16, 32, 4, 1, 4]),  # two blocks of rows: tiles along both
    (16, 512, [64, 128, 4, 1, 64]),  # more splits asked for than there are
])
@pytest.mark.parametrize("bias", [False, True])
def test_the_last_split_to_finish_sums_them_as_the_second_kernel_did(rows, k, config, bias, matmul, monkeypatch):
    packed, qs = nf4_quantized(96, k, seed=k)
    x = torch.randn(rows, k).to(DEVICE, torch.bfloat16)
    b = torch.randn(96).to(DEVICE, torch.bfloat16) if bias else None
    second = []
    real_sum = nf4.sum_splits
    monkeypatch.setattr(nf4, "sum_splits", lambda *a: second.append(1) or real_sum(*a))
    in_kernel = matmul(x, packed, b, quant_state=qs, config=config)
    assert not second  # summed in the tile kernel,
    assert not arrivals._counters[torch.device(DEVICE)].any()  # every counter back at 0 for the next launch
    monkeypatch.setattr(arrivals, "COUNTERS", 0)  # no buffer large enough: the second kernel sums them
    two_kernels = matmul(x, packed, b, quant_state=qs, config=config)
    assert second and torch.equal(in_kernel, two_kernels)  # bit for bit: the same order, rounded once


def test_split_counters_are_not_made_inside_a_graph_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert arrivals.split_counters(torch.device("cuda"), 8) is None  # an allocation there would belong to the graph
    assert arrivals.split_counters(torch.device("cpu"), arrivals.COUNTERS + 1) is None  # more tiles than counters
    assert arrivals.split_counters(torch.device("cpu"), 8).dtype == torch.int32


def test_the_record_counts_the_layers_that_take_measured_settings(monkeypatch):
    for rows in (16, 32):  # as if these shapes were measured at both row tiles
        monkeypatch.setitem(nf4_settings.TUNED_SM90, (192, 256, 64, rows), [64, 64, 4, 1, 2])
    monkeypatch.setitem(nf4_settings.TUNED_SM90, (128, 192, 64, 16), [64, 64, 4, 1, 2])  # and this one at 16 rows only
    model = nf4_model(nf4_layer(256, 192), nf4_layer(256, 192), nf4_layer(192, 128))
    assert nf4.measured_settings(model).startswith("tile settings measured on an H200 for 2 of 3 layers")


def test_sm90_takes_the_measured_settings_of_its_shapes_and_the_rest_the_rule(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(nf4_settings, "_sms", lambda device: 132)  # an H200's
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gate_up = (12288, 4096, 64)
    assert nf4_settings.config(32, *gate_up, cuda) == [128, 64, 4, 1, 6]
    assert nf4_settings.config(8, *gate_up, cuda) == nf4_settings.TUNED_SM90[(*gate_up, 16)]  # 8 rows run the 16-row tiles
    for rows, shape in ((48, gate_up), (32, (3584, 3584, 64)), (32, (*gate_up[:2], 128))):  # not measured
        assert nf4_settings.config(rows, *shape, cuda) == nf4_settings.rule_config(rows, *shape, cuda)
    assert nf4_settings.rule_config(32, *gate_up, cuda) == [64, 64, 4, 1, 3]  # 192 programs: 3 splits, ~4 an SM
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))  # not measured there
    assert nf4_settings.config(32, *gate_up, cuda) == [64, 64, 4, 1, 3]
    # each setting is whole tiles of whole blocks, as `launch` asks
    assert all(tile % (blocksize // 2) == 0 for (_, _, blocksize, _), (_, tile, *_) in nf4_settings.TUNED_SM90.items())


@KERNELS
@pytest.mark.parametrize(("weight_dtype", "dtype", "nested", "blocksize"), [
    (torch.float32, torch.bfloat16, True, 64),  # weights quantized from fp32: rounded once, to bf16
    (torch.bfloat16, torch.float16, True, 64),  # bf16 weights, fp16 activations: rounded to bf16, then fp16
    (torch.float16, torch.bfloat16, False, 128),  # no double quantisation, another blocksize
    (torch.bfloat16, torch.bfloat16, True, 32),
    (torch.bfloat16, torch.float16, True, 256),  # one block a tile row in the interpreter
])
def test_other_quant_states(weight_dtype, dtype, nested, blocksize, matmul):
    packed, qs = nf4_quantized(64, 256, weight_dtype=weight_dtype, nested=nested, blocksize=blocksize, seed=2)
    x = torch.randn(4, 256).to(DEVICE, dtype)
    _check(matmul(x, packed, quant_state=qs), x, packed, qs)


@pytest.mark.parametrize("nested", [True, False])
def test_the_torch_fallback_dequantizes_as_bitsandbytes(nested):
    packed, qs = nf4_quantized(64, 256, weight_dtype=torch.float32, nested=nested, seed=3)
    parts = ((qs.state2.code, qs.state2.absmax, qs.offset, qs.state2.blocksize) if nested
             else (None, None, None, 1))
    code2, absmax2, offset, blocksize2 = parts
    ours = nf4.dequantize(packed.view(64, 128), qs.absmax, code2, absmax2, offset, qs.code, 64, blocksize2)
    assert torch.equal(ours, BF.dequantize_4bit(packed, qs))


@KERNELS
def test_a_kernel_that_cannot_run_falls_back_once_with_the_reason(matmul, monkeypatch, caplog):
    monkeypatch.setattr(nf4, "launch", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("no PTX for this GPU")))
    packed, qs = nf4_quantized(64, 256)
    x = torch.randn(2, 256).to(DEVICE, torch.bfloat16)
    for _ in range(2):
        got = matmul(x, packed, quant_state=qs)
    assert torch.equal(got, F.linear(x, BF.dequantize_4bit(packed, qs).to(x.dtype)))
    assert list(nf4._failed.values()) == ["RuntimeError: no PTX for this GPU"]
    assert sum("nf4 matmul kernel cannot run" in r.message for r in caplog.records) == 1


class _Tiles:
    """A stand-in for `nf4.launch`'s tile launch: what it was given, and the output it writes (the loads' x + 1,
    the shuffles' x + 1 + `shuffle_error`, or a raise)."""

    def __init__(self, shuffle_error=0.0, raises=False):
        self.calls, self.shuffle_error, self.raises = [], shuffle_error, raises

    def __call__(self, xs, shuffle):
        self.calls.append((xs.clone(), xs.stride(), shuffle))
        if shuffle and self.raises:
            raise RuntimeError("ptxas: unknown instruction shfl.sync.idx")
        return xs.float() + 1 + (self.shuffle_error if shuffle else 0.0)


def _strided_x(rows=4, k=64):
    return torch.zeros(rows, k + 16, dtype=torch.bfloat16)[:, :k]  # x's rows 80 apart, as a slice of a wider tensor


def test_the_shuffles_are_taken_where_they_write_what_the_loads_write_checked_once(monkeypatch):
    monkeypatch.setattr(nf4, "_shuffles", {})
    x, tiles = _strided_x(), _Tiles()
    assert nf4.shuffles_hold(x, 32, tiles, {"BLOCK_N": 64, "num_warps": 4})
    (probe, stride, first), (again, _, second) = tiles.calls
    assert (first, second) == (True, False) and torch.equal(probe, again)
    assert probe.shape == x.shape and stride == x.stride()  # x's row stride: Triton specialises on it
    assert probe.abs().sum() > 0  # a zero x would hide any wrong table value
    assert nf4.shuffles_hold(x, 32, tiles, {"BLOCK_N": 64, "num_warps": 4}) and len(tiles.calls) == 2  # recorded
    assert nf4.shuffles_hold(x, 32, tiles, {"BLOCK_N": 128, "num_warps": 4}) and len(tiles.calls) == 4  # new settings


@pytest.mark.parametrize("tiles", [_Tiles(shuffle_error=2.0**-20), _Tiles(raises=True)], ids=["differ", "raise"])
def test_shuffles_that_differ_from_the_loads_or_cannot_build_leave_the_loads_with_a_warning(tiles, monkeypatch,
                                                                                               caplog):
    monkeypatch.setattr(nf4, "_shuffles", {})
    x = _strided_x()
    assert not nf4.shuffles_hold(x, 32, tiles, {"BLOCK_N": 64})
    assert not nf4.shuffles_hold(x, 32, tiles, {"BLOCK_N": 64})
    assert sum("warp shuffle" in r.message and "loads instead" in r.message for r in caplog.records) == 1
    assert [shuffle for *_, shuffle in tiles.calls] == ([True] if tiles.raises else [True, False])


def test_an_unaligned_x_takes_the_loads_unchecked(monkeypatch):
    monkeypatch.setattr(nf4, "_shuffles", {})
    tiles = _Tiles()
    x = torch.zeros(4 * 64 + 1, dtype=torch.bfloat16)[1:].view(4, 64)  # 2 bytes past an aligned start
    assert not nf4.shuffles_hold(x, 32, tiles, {}) and not tiles.calls and not nf4._shuffles


def test_the_interpreter_runs_the_table_loads(monkeypatch):
    """Triton's interpreter cannot run the shuffles' PTX: a launch there never checks or takes them."""
    if DEVICE == "cuda":
        pytest.skip("on a GPU the launch checks the shuffles")
    monkeypatch.setattr(nf4, "_shuffles", {})
    packed, qs = nf4_quantized(64, 256)
    x = torch.randn(2, 256).to(DEVICE, torch.bfloat16)
    _check(nf4.nf4_matmul(x, packed, quant_state=qs), x, packed, qs)
    assert nf4._shuffles == {}


def test_nf4_decode_routes_token_steps_and_leaves_the_rest_to_bitsandbytes(launches):
    model = nf4_model(nf4_layer(256, 192), torch.nn.ReLU(), nf4_layer(192, 128, bias=False))
    step, prompt = (torch.randn(4, 1, 256).to(DEVICE, torch.bfloat16), torch.randn(2, 40, 256).to(DEVICE, torch.bfloat16))
    with torch.no_grad():
        # the reference is dequantize + matmul: on a GPU bitsandbytes' own one-row forward is a gemv of its own
        # rounding (benchmarks/results/h200_nf4_matmul.md)
        dense = torch.nn.Sequential(*[torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
                                      if isinstance(layer, bnb.nn.Linear4bit) else layer for layer in model])
        for d, layer in zip(dense, model):
            if isinstance(layer, bnb.nn.Linear4bit):
                d.weight.data = BF.dequantize_4bit(layer.weight.data, layer.weight.quant_state).to(step.dtype)
                if layer.bias is not None:
                    d.bias.data = layer.bias.data.to(step.dtype)
        expected = dense.to(DEVICE, step.dtype)(step)
        with nf4.nf4_decode(model) as reason:
            got = model(step)  # 4 rows: a token step
            assert launches == [4, 4]
            model(prompt)  # 80 rows: a prompt pass
            model(step[:1])  # one row: bitsandbytes' gemv on a GPU
            assert launches == [4, 4]
    with nf4.nf4_decode(model):
        model(step.requires_grad_())  # the loss pass: gradients
    assert reason is None and launches == [4, 4]
    assert all("forward" not in layer.__dict__ for layer in model)  # bitsandbytes' own forward again
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-3)  # two layers, each within a unit


def test_the_fast_path_routes_a_trainers_token_steps_for_its_life(launches, monkeypatch):
    """`enable_fast_generation` on a 4-bit base, where the GPU rule lets it (here patched to, as on an H200): every
    rollout's token steps go through the kernel, the loss pass stays on bitsandbytes, the record says so."""
    from vlmrl.engine.rollout import step_graph
    from vlmrl.engine.rollout.fast import STEP_GRAPH, enable_fast_generation

    monkeypatch.setattr(nf4, "gpu_reason", lambda device: None)
    monkeypatch.setattr(step_graph, "cuda_reason", lambda model: None)  # (Triton's interpreter on a CPU)
    model = nf4_model(nf4_layer(256, 192))
    step = torch.randn(4, 1, 256).to(DEVICE, torch.bfloat16)
    trainer = nf4_rollout_trainer(model, step)
    fast = enable_fast_generation(trainer)
    assert fast.weights == ("vlmrl nf4 kernel (vlmrl.engine.rollout.nf4) for token steps of 2-64 rows (tile "
                            "settings measured on an H200 for 0 of 1 layers at 2-32 rows (nf4_settings.TUNED_SM90), by rule "
                            f"otherwise; {nf4.lookups()}), bitsandbytes Linear4bit otherwise")
    on_gpu = "table lookups by warp shuffle (each setting checked against the loads: 1 of 1 equal so far)"
    assert nf4.lookups() == ("table lookups by loads (Triton's interpreter runs no PTX)" if DEVICE == "cpu" else on_gpu)
    assert launches == [2]  # the probe
    assert fast.step_graph == STEP_GRAPH and fast.mode == trainer.generation_config.compile_config.mode == "default"
    fast.graphs._failed("a capture error")  # the first step that cannot be recorded: graph trees from then on
    assert trainer.generation_config.compile_config.mode == "reduce-overhead"
    assert fast.as_dict()["step_graph"] == f"{STEP_GRAPH}, then CUDA graph trees from a later rollout on (a capture error)"
    assert "graphs" not in fast.as_dict()
    assert [name for name, _ in trainer.vlmrl_rollout_contexts][-2:] == ["step_graph", "compile_over_4bit"]
    trainer._generate_single_turn()
    trainer._generate_single_turn()
    assert launches == [2, 4, 4]
    model(step.requires_grad_())  # the loss pass
    assert launches == [2, 4, 4]
    trainer.vlmrl_nf4_decode.close()
    assert "forward" not in model[0].__dict__


def test_where_the_fast_path_leaves_4bit_token_steps_on_bitsandbytes(launches, monkeypatch):
    """The record says why: no 4-bit layer (nothing), vlmrl's kernels off, a GPU where the kernel was not measured
    faster, a kernel that cannot run there (the probe); and the rule itself, by compute capability."""
    from vlmrl.engine.rollout.quantized_base import nf4_token_steps

    model = nf4_model(nf4_layer(256, 64))
    trainer = nf4_rollout_trainer(model, None)
    assert nf4_token_steps(nf4_rollout_trainer(torch.nn.Linear(4, 4), None)) is None
    assert nf4_token_steps(trainer, wanted=False) == ("bitsandbytes Linear4bit (vlmrl's kernels are off: "
                                                      "train.rollout.kernels=false)")
    if DEVICE == "cpu":
        assert "not a CUDA device" in nf4_token_steps(trainer)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert nf4.gpu_reason(torch.device("cuda", 0)) == ("measured faster than bitsandbytes on sm_90 (H100/H200) "
                                                       "only; this GPU is sm_89")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert nf4.gpu_reason(torch.device("cuda", 0)) is None
    monkeypatch.setattr(nf4, "gpu_reason", lambda device: None)
    monkeypatch.setattr(nf4, "launch", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("no PTX for this GPU")))
    assert nf4_token_steps(trainer) == ("bitsandbytes Linear4bit (vlmrl's nf4 kernel not used: RuntimeError: no PTX "
                                        "for this GPU)")
    assert "forward" not in model[0].__dict__ and getattr(trainer, "vlmrl_nf4_decode", None) is None


def test_an_unsupported_model_is_left_alone_with_the_reason(monkeypatch, launches):
    assert nf4.unsupported_reason(torch.nn.Linear(4, 4)) == "the model has no bitsandbytes Linear4bit layer"
    fp4 = nf4_model(nf4_layer(256, 64, quant_type="fp4"))
    assert "quant_type fp4" in nf4.unsupported_reason(fp4)
    with torch.no_grad(), nf4.nf4_decode(fp4) as reason:
        fp4(torch.randn(2, 256).to(DEVICE, torch.bfloat16))
    assert "fp4" in reason and launches == []
    odd = nf4_model(nf4_layer(256, 64), nf4_layer(64, 96), nf4_layer(96, 64))  # 96 inputs: not a whole number of blocks
    assert nf4.unsupported_reason(odd) is None
    with torch.no_grad(), nf4.nf4_decode(odd):
        odd(torch.randn(2, 256).to(DEVICE, torch.bfloat16))
    assert launches == [2, 2]
    if DEVICE == "cpu":
        monkeypatch.setattr(nf4, "interpreted", lambda: False)
        assert "not a CUDA device" in nf4.unsupported_reason(odd)


def test_a_compiled_token_step_calls_it_as_one_node():
    layer = nf4_layer(256, 64)
    x = torch.randn(3, 256).to(DEVICE, torch.bfloat16)
    with torch.no_grad(), nf4.nf4_decode(layer):
        got, nodes = compiled_calls(layer, x)
    assert [n for n in nodes if "nf4" in n] == ["vlmrl.nf4_matmul.default"]
    _check(got, x, layer.weight, layer.weight.quant_state, layer.bias)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@KERNELS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qwen3_vl_8b_shapes_on_the_gpu(dtype, matmul):
    """At the 8B shapes each output is within 0.6 of a unit of the exact product of the same rounded weights (float64
    sums), as on the CPU, outputs near zero counted at `nf4_units`' floor; in bf16 also within one unit of cuBLAS's
    dequantize + matmul. Not in fp16: there cuBLAS's own sums were 2 units from the kernel's on an H200 and 1.34 on
    an H100 (benchmarks/NOTES.md), so that reference cannot judge the kernel."""
    # (out, in) of q/o, k/v, gate/up and down
    for n, k in [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288)]:
        packed, qs = nf4_quantized(n, k, weight_dtype=torch.bfloat16, seed=n + k)
        weight = BF.dequantize_4bit(packed, qs).to(dtype)
        for rows in (1, 8, 32, 64):
            x = torch.randn(rows, k, device="cuda").to(dtype)
            bias = torch.randn(n, device="cuda").to(dtype)
            got = matmul(x, packed, bias, quant_state=qs)
            exact = F.linear(x.double(), weight.double(), bias.double())
            scale = x.float().abs() @ weight.float().abs().T + bias.float().abs()
            units = nf4_units(got, exact, scale)
            assert units.max() <= 0.6, f"{(n, k, rows)}: {float(units.max()):.2f} units from the exact product"
            if dtype == torch.bfloat16:
                _check(got, x, packed, qs, bias, min_equal=0.9)
    _exact_weights(1024, 4096, dtype, matmul=matmul)  # 4M weights, each as bitsandbytes dequantizes it (and rounds it)
    assert not nf4._failed
    _splits_summed_in_the_kernel_as_by_the_second(dtype, matmul)
    if torch.cuda.get_device_capability()[0] == nf4_settings.MEASURED_MAJOR:  # where the shuffles were measured: they hold
        assert nf4._shuffles and all(nf4._shuffles.values()), nf4.lookups()


def _splits_summed_in_the_kernel_as_by_the_second(dtype, matmul, repeats=50):
    """On a GPU, where a tile's splits finish in any order: the last to arrive reads every other's share (the
    counters' release and acquire order them), so the sums equal the second kernel's bit for bit, launch after
    launch, and every counter is back at 0."""
    n, k = 4096, 12288  # down: 8 splits of 32 tiles at 32 rows on an H200
    packed, qs = nf4_quantized(n, k, weight_dtype=torch.bfloat16, seed=7)
    x = torch.randn(32, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    runs = [matmul(x, packed, bias, quant_state=qs) for _ in range(repeats)]
    counters = arrivals._counters[torch.device("cuda", torch.cuda.current_device())]
    assert not counters.any()
    saved, arrivals.COUNTERS = arrivals.COUNTERS, 0
    try:
        expected = matmul(x, packed, bias, quant_state=qs)
    finally:
        arrivals.COUNTERS = saved
    assert all(torch.equal(run, expected) for run in runs)


def test_packed_weights_off_a_word_boundary_stay_off_the_kernel(launches):
    """The kernel reads packed weights as 32-bit words: bytes that start off a 4-byte boundary (a view into a larger
    buffer) take dequantize + matmul, with nothing recorded against the device, and a layer holding such weights
    is not routed at all."""
    packed, qs = nf4_quantized(64, 256, seed=2)
    buffer = torch.empty(packed.numel() + 1, dtype=torch.uint8, device=packed.device)
    shifted = buffer[1:].view(packed.shape)
    shifted.copy_(packed)
    assert shifted.data_ptr() % nf4.WORD
    x = torch.randn(3, 256).to(DEVICE, torch.bfloat16)
    expected = F.linear(x, BF.dequantize_4bit(packed, qs).to(x.dtype))  # dequantize + matmul, the fallback
    assert torch.equal(nf4.nf4_matmul(x, shifted, quant_state=qs), expected)
    assert launches == [] and not nf4._failed
    with pytest.raises(ValueError, match="multiple of 4"):
        nf4.launch(x, shifted.view(64, 128), qs.absmax, None, None, None, qs.code, None, qs.blocksize, 1, 1, [])
    layer = nf4_layer(256, 64)
    data = layer.weight.data
    moved = torch.empty(data.numel() + 1, dtype=data.dtype, device=data.device)[1:].view(data.shape)
    moved.copy_(data)
    layer.weight.data = moved
    assert "not 4-byte aligned" in nf4.layer_reason(layer)
