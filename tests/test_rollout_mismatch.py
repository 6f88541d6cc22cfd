"""The rollout engine against the loss pass (vlmrl.engine.rollout.sampling, vlmrl.engine.rollout.mismatch).

- In float32 the sampler's log-probs of the tokens it sampled equal the loss pass's (TRL's own
  `_get_per_token_logps_and_entropies` with its fused head), on every tiny family, left padding and images in.
- The TIS factor is 1 when they are equal; with a known mismatch injected, the factor and TRL's own `_compute_loss`
  (run on a stand-in trainer) match a hand computation, per token (GRPO) and per completion (GSPO), capped at 3.
- A real training run on the CPU logs the four mismatch columns every step, measured against the loss pass's own
  log-probs (no extra forward), and records how; the health monitor warns on a jump, a drift or truncation.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import types
from collections import defaultdict

import pytest
import torch
import trl.trainer.utils as trl_utils
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.trainer_callback import TrainerControl
from trl import GRPOTrainer

from vlmrl.common.io import read_json, read_jsonl
from vlmrl.engine.rollout.mismatch import (
    COLUMNS,
    LOGP_DIFF_MAX,
    LOGP_DIFF_MEAN,
    OUTSIDE_CAP,
    SEQUENCE_KL,
    MismatchWatch,
    enable_rollout_mismatch,
    micro_batch_stats,
    tis_factor,
)
from vlmrl.engine.rollout.sampling import SamplerLogprobs, _with_processor, enable_sampler_logprobs
from vlmrl.models.tiny import build_tiny_model

FAMILIES = ["qwen3_vl", "qwen2_5_vl", "gemma3", "idefics3"]
TEMPERATURE, NEW_TOKENS = 0.7, 8


# --- the sampler's log-probs equal the loss pass's in float32 ------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mismatch")
    return {arch: build_tiny_model(arch, root / arch) for arch in FAMILIES}


def _loss_pass(model):
    """TRL's own log-prob pass on a stand-in trainer (what it reads of a GRPOTrainer), its fused head added as
    GRPOTrainer.__init__ adds it."""
    trl_utils.add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    fake = types.SimpleNamespace(model=model, state=types.SimpleNamespace(global_step=0),
                                 args=types.SimpleNamespace(report_to=[]),
                                 accelerator=types.SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True))
    return types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, fake)


@pytest.mark.parametrize("arch", FAMILIES)
def test_rollout_logprobs_equal_the_loss_pass_in_float32(arch, folders):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(folders[arch]), dtype=torch.float32).eval()
    logps_of = _loss_pass(model)
    processor = AutoProcessor.from_pretrained(str(folders[arch]))
    processor.tokenizer.padding_side = "left"
    texts = [f"{processor.image_token} how many squares" + " are there" * i for i in range(3)]  # left padding
    pictures = [[Image.new("RGB", (64, 64), c)] for c in ("white", "red", "blue")]
    prompt = processor(text=texts, images=pictures, padding=True, return_tensors="pt")
    recorder = SamplerLogprobs(TEMPERATURE)
    with _with_processor(model, recorder) as seen, torch.no_grad():
        # top_k truncates after the recorder: the log-probs are TRL's, before truncation
        sequences = model.generate(**prompt, do_sample=True, temperature=TEMPERATURE, top_k=20, top_p=1.0,
                                   repetition_penalty=1.0, max_new_tokens=NEW_TOKENS)
    assert "generate" not in vars(model)  # the processor is passed for the block only
    sampled = seen[0]  # [B, T]
    completion = sequences[:, prompt["input_ids"].shape[1]:]
    width = completion.shape[1]
    assert sampled.shape == (3, width) and (sampled <= 0).all()
    eos = torch.isin(completion, torch.tensor(model.generation_config.eos_token_id).flatten())
    first = torch.where(eos.any(1), eos.int().argmax(1), width)  # TRL's completion mask: up to the first EOS
    completion_mask = (torch.arange(width)[None] <= first[:, None]).long()
    kwargs = {k: prompt[k] for k in ("pixel_values", "image_grid_thw", "pixel_attention_mask") if k in prompt}
    for name in ("mm_token_type_ids", "token_type_ids"):
        if name in prompt:
            kwargs[name] = torch.cat([prompt[name], torch.zeros_like(completion_mask)], 1)
    with torch.no_grad():
        loss_pass, _, _ = logps_of(model, sequences, torch.cat([prompt["attention_mask"], completion_mask], 1),
                                   width, num_images=[1, 1, 1], **kwargs)
        # The sampler drew from the model's distribution less the tokens generate suppresses (the image tokens,
        # in the tiny models' generation config as in vlmrl's training): their share of the mass, here ~0.2%
        # (random weights), is the one difference. The loss pass knows no suppression.
        logits = model(input_ids=sequences, attention_mask=torch.cat([prompt["attention_mask"], completion_mask], 1),
                       **kwargs).logits[:, -width - 1:-1].float() / TEMPERATURE
    suppressed = torch.logsumexp(torch.log_softmax(logits, -1)[..., model.generation_config.suppress_tokens], -1)
    real = completion_mask.bool()
    assert real.sum() >= 3 and model.generation_config.suppress_tokens
    torch.testing.assert_close(sampled[real], (loss_pass - torch.log1p(-suppressed.exp()))[real], atol=2e-5, rtol=0)
    factor = tis_factor(loss_pass, sampled, completion_mask, level="token", cap=3.0)  # (1 - suppressed mass)
    torch.testing.assert_close(factor[real], (1 - suppressed.exp())[real], atol=1e-4, rtol=0)


def test_the_recorder_drops_a_step_generate_undid():
    """With the stop check deferred, generate runs one step more and then removes its token."""
    recorder = SamplerLogprobs()
    recorder(torch.tensor([[5]]), torch.tensor([[0.0, 0.0]]))
    recorder(torch.tensor([[5, 1]]), torch.tensor([[0.0, math.log(3.0)]]))
    recorder(torch.tensor([[5, 1, 1]]), torch.tensor([[9.0, 0.0]]))  # the step undone
    steps = recorder.finish(torch.tensor([[5, 1, 1]]))
    torch.testing.assert_close(steps, torch.tensor([[math.log(0.5), math.log(0.75)]]))


def test_logprobs_reach_trl_as_vllms_do():
    """TRL's transformers path returns (completion_ids, None); the wrapper fills the second with one list per
    completion, cut where TRL cut the completion (its first EOS)."""

    class Model(torch.nn.Module):
        def generate(self, input_ids, logits_processor=None, **kwargs):
            ids = input_ids
            for scores in (torch.tensor([[0.0, 1.0, 2.0]] * 2), torch.tensor([[2.0, 0.0, 0.0]] * 2)):
                logits_processor(ids, scores)
                ids = torch.cat([ids, torch.tensor([[2], [0]])], 1)  # row 0 samples 2 then 2; row 1 0 then 0
            return ids

    model = Model()

    def trls(prompt_ids, images, multimodal_fields, num_generations):  # TRL's, less the padding and EOS cut
        model.generate(torch.tensor(prompt_ids))
        return [[2, 2], [0]], None

    trainer = types.SimpleNamespace(temperature=1.0, model_wrapped=model, _generate_single_turn=trls,
                                    accelerator=types.SimpleNamespace(unwrap_model=lambda m: m))
    assert enable_sampler_logprobs(trainer).startswith("the sampler's")
    completion_ids, logprobs = trainer._generate_single_turn([[7], [7]], None, {}, 2)
    first = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0]), 0)
    second = torch.log_softmax(torch.tensor([2.0, 0.0, 0.0]), 0)
    assert completion_ids == [[2, 2], [0]]
    assert logprobs[0] == pytest.approx([first[2].item(), second[2].item()])
    assert logprobs[1] == pytest.approx([first[0].item()])  # cut at its EOS, as TRL cut the completion
    assert "generate" not in vars(model)


# --- the correction against a hand computation ---------------------------------------------------------------


def test_the_factor_is_one_when_the_log_probs_are_equal():
    logps = torch.tensor([[-0.3, -2.0, -7.5], [-1.0, -0.1, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    for level in ("token", "sequence"):
        factor = tis_factor(logps, logps.clone(), mask, level=level, cap=3.0)
        assert torch.equal(factor, torch.ones_like(factor))
    size, tokens, largest, k3, sequences, outside = micro_batch_stats(logps, logps.clone(), mask, 3.0).tolist()
    assert (size, tokens, largest, k3, sequences, outside) == (0.0, 5.0, 0.0, 0.0, 2.0, 0.0)


# One completion of 3 tokens and one of 2 (its third column is padding), advantages +1 and -1. The loss pass's
# log-probs (what TRL computes) against the sampler's, which drew them: log ratios loss - rollout per token
#   row 0: +0.5, -0.2, +2.0 (ratio e^2 = 7.39: over the cap 3)      row 1: -1.5, +0.1, (padding)
LOSS_PASS = torch.tensor([[-1.0, -0.7, -0.5], [-2.0, -0.4, -3.0]])
ROLLOUT = torch.tensor([[-1.5, -0.5, -2.5], [-0.5, -0.5, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADVANTAGES = torch.tensor([1.0, -1.0])
MAX_LENGTH = 3  # dr_grpo divides the token sum by rows x max_completion_length


def _stand_in(level: str, logps: torch.Tensor) -> types.SimpleNamespace:
    """What TRL 1.16's `_compute_loss` reads of a GRPOTrainer (dr_grpo, no KL term, no entropy tricks), with the
    loss pass's forward replaced by `logps` (made a leaf with gradients)."""
    fake = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True, parameters=lambda: iter(())), aux_loss_enabled=False,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=0.0,
        loss_type="dr_grpo", epsilon_low=0.2, epsilon_high=0.2, use_vllm=False,
        vllm_importance_sampling_correction=True, vllm_importance_sampling_clip_max=3.0,
        vllm_importance_sampling_clip_min=None, current_gradient_accumulation_steps=1, max_completion_length=MAX_LENGTH,
        _entropy_bonus_enabled=False, num_iterations=1, temperature=1.0,
        args=types.SimpleNamespace(delta=None, gradient_accumulation_steps=1, steps_per_generation=1, bf16=False,
                                   fp16=False),
        accelerator=types.SimpleNamespace(sync_gradients=True, gather=lambda t: t,
                                          reduce=lambda t, reduction="sum": t),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _generate_single_turn=lambda *a: None,
    )
    fake.leaf = logps.clone().requires_grad_(True)
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (fake.leaf, torch.zeros_like(fake.leaf), None)
    fake._compute_loss = types.MethodType(GRPOTrainer._compute_loss, fake)
    return fake


def _inputs(**extra) -> dict:
    return {"prompt_ids": torch.zeros(2, 1, dtype=torch.long), "prompt_mask": torch.ones(2, 1, dtype=torch.long),
            "completion_ids": torch.zeros(2, 3, dtype=torch.long), "completion_mask": MASK, "advantages": ADVANTAGES,
            "sampling_per_token_logps": ROLLOUT, **extra}


def test_trl_multiplies_by_the_ratio_only_where_the_two_flags_say_so():
    """The correction raises `use_vllm` and `vllm_importance_sampling_correction` for one `_compute_loss` call:
    in TRL's `_compute_loss` those flags must gate that multiplication and nothing else."""
    source = inspect.getsource(GRPOTrainer._compute_loss)
    assert source.count("self.use_vllm") == 1 and source.count("vllm_importance_sampling_correction") == 1
    gate = source.index("if self.use_vllm and self.vllm_importance_sampling_correction")
    assert 'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]' in source[gate:gate + 200]
    assert "use_vllm" not in inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_known_mismatch_gives_the_hand_computed_factor_and_capped_loss(level):
    fake = _stand_in(level, LOSS_PASS)
    record = enable_rollout_mismatch(fake, correction="tis")
    assert record.correction == "tis" and record.reason == "train.rollout_correction=tis"
    assert record.reference.startswith("the loss pass's own log-probs")
    inputs = _inputs()
    loss = fake._compute_loss(None, inputs)
    if level == "token":  # min(e^x, 3) per token
        factor = [[math.exp(0.5), math.exp(-0.2), 3.0], [math.exp(-1.5), math.exp(0.1), 1.0]]
        # the policy ratio is 1 (old = current, detached): per-token loss -A x factor, summed over real tokens
        expected = (-(factor[0][0] + factor[0][1] + factor[0][2]) + (factor[1][0] + factor[1][1])) / (2 * MAX_LENGTH)
    else:  # min(e^(sum of the row's log ratios), 3), one per completion
        factor = [[min(math.exp(0.5 - 0.2 + 2.0), 3.0)], [math.exp(-1.5 + 0.1)]]
        expected = (-factor[0][0] * 3 + factor[1][0] * 2) / (2 * MAX_LENGTH)
    torch.testing.assert_close(inputs["importance_sampling_ratio"], torch.tensor(factor))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert fake.use_vllm is False  # raised for the call only
    # the gradient carries the factor too: d loss / d log p = -A x factor / (rows x max length) per real token
    loss.backward()
    if level == "token":
        want = torch.tensor([[-f for f in factor[0]], [factor[1][0], factor[1][1], 0.0]]) / (2 * MAX_LENGTH)
        torch.testing.assert_close(fake.leaf.grad, want)
    # the step's numbers: |Δ| = 0.5, 0.2, 2.0, 1.5, 0.1 over 5 tokens; 2.0 and 1.5 leave [1/3, 3]
    row = {k: v[0] for k, v in fake._metrics["train"].items()}
    assert row[LOGP_DIFF_MEAN] == pytest.approx(4.3 / 5) and row[LOGP_DIFF_MAX] == pytest.approx(2.0)
    assert row[OUTSIDE_CAP] == pytest.approx(2 / 5)
    k3 = sum(math.expm1(d) - d for d in (0.5, -0.2, 2.0, -1.5, 0.1))
    assert row[SEQUENCE_KL] == pytest.approx(k3 / 2, rel=1e-5)  # KL per completion: k3 summed, mean over 2


def test_without_the_correction_the_loss_is_trls_and_the_mismatch_is_still_measured():
    fake = _stand_in("token", LOSS_PASS)
    enable_rollout_mismatch(fake, correction="none")
    inputs = _inputs()
    loss = fake._compute_loss(None, inputs)
    assert "importance_sampling_ratio" not in inputs
    assert loss.item() == pytest.approx((-3 + 2) / (2 * MAX_LENGTH))
    assert set(COLUMNS) <= set(fake._metrics["train"])


def test_where_trl_computed_old_log_probs_they_are_the_reference():
    """steps_per_generation over the accumulation steps: the policy at generation time, not the current one."""
    fake = _stand_in("token", LOSS_PASS + 5.0)  # the current policy has moved; the old one is LOSS_PASS
    fake.args.steps_per_generation = 2
    record = enable_rollout_mismatch(fake, correction="tis")
    assert record.reference.startswith("TRL's old_per_token_logps")
    inputs = _inputs(old_per_token_logps=LOSS_PASS)
    fake._compute_loss(None, inputs)
    torch.testing.assert_close(inputs["importance_sampling_ratio"][0, :2], torch.tensor([math.exp(0.5), math.exp(-0.2)]))


def test_auto_corrects_where_the_numerics_differ():
    fake = _stand_in("token", LOSS_PASS)
    assert enable_rollout_mismatch(fake, correction="auto").correction == "none"  # float32, no fast path
    fake = _stand_in("sequence", LOSS_PASS)
    record = enable_rollout_mismatch(fake, correction="auto", fast=True)
    assert record.correction == "tis" and "fast rollout engine" in record.reason
    fake = _stand_in("token", LOSS_PASS)
    fake.use_vllm = True  # TRL's vLLM path: vLLM's log-probs, TRL's own correction, vlmrl measures
    record = enable_rollout_mismatch(fake, correction="tis")
    assert record.correction == "trl" and record.sampler.startswith("vLLM") and "old_per_token" in record.reference


# --- a real run, and the health monitor ---------------------------------------------------------------------


def test_a_training_run_logs_the_mismatch_every_step(tmp_path, monkeypatch):
    from tests.helpers import quick_config, step_rows, varied_reward
    from vlmrl.pipeline import prepare_with_budget
    from vlmrl.train.stage import train

    monkeypatch.setattr("vlmrl.grading.rewards.correctness_reward", varied_reward)
    config = quick_config(tmp_path, "train.algorithm=grpo", "train.rollout_correction=tis",
                          "train.gradient_accumulation_steps=2", "train.per_device_train_batch_size=4")
    prepare_with_budget(config, config.run_dir)
    train(config, config.run_dir)
    rows = step_rows(config.run_dir / "train" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # float32 on the CPU: the rollout's numbers are the loss pass's but for the 4 multimodal tokens the sampler
        # may not draw (`suppress_tokens`), whose share of a random-weight model's mass over the tiny vocabulary
        # (1,024 entries) is about 0.4% (a trained model puts next to nothing there)
        assert 0 < row[LOGP_DIFF_MEAN] <= row[LOGP_DIFF_MAX] < 0.02
        assert 0 <= row[SEQUENCE_KL] < 1e-3 and row[OUTSIDE_CAP] == 0
    record = read_json(config.run_dir / "train" / "summary.json")["rollout_correction"]
    assert record["correction"] == "tis" and record["level"] == "token" and record["cap"] == 3.0
    assert record["sampler"].startswith("the sampler's") and "no extra forward" in record["reference"]
    assert record["measured_micro_batches"] == 4 and record["steps_logged"] == 2  # 2 micro-batches per step
    assert not [w for r in read_jsonl(config.run_dir / "train" / "health.jsonl") for w in r["warnings"] if "mismatch" in w]


def test_measuring_alone_changes_no_weight(tmp_path, monkeypatch):
    """`none` (auto on the CPU): the recorder draws no random numbers and the loss is TRL's, so the adapter is the
    one a run without any of it trains, byte for byte."""
    import hashlib

    from tests.helpers import quick_config, varied_reward
    from vlmrl.engine.rollout import mismatch
    from vlmrl.pipeline import prepare_with_budget
    from vlmrl.train.stage import train

    monkeypatch.setattr("vlmrl.grading.rewards.correctness_reward", varied_reward)
    adapters = []
    for measured in (True, False):
        config = quick_config(tmp_path / str(measured), "train.max_steps=1", "train.per_device_train_batch_size=4")
        prepare_with_budget(config, config.run_dir)
        with monkeypatch.context() as patch:
            if not measured:
                patch.setattr(mismatch, "enable_rollout_mismatch",
                              lambda trainer, **kwargs: mismatch.RolloutMismatch("-", "none", "-", "-", None, "-"))
            train(config, config.run_dir)
        adapters.append(hashlib.sha256((config.run_dir / "train/final/adapter_model.safetensors").read_bytes()).digest())
        assert (LOGP_DIFF_MEAN in read_jsonl(config.run_dir / "train" / "metrics.jsonl")[0]) is measured
    assert adapters[0] == adapters[1]


def test_the_watch_warns_on_a_jump_a_drift_and_truncation():
    watch = MismatchWatch()
    assert [watch.check({LOGP_DIFF_MEAN: 1e-7}) for _ in range(5)] == [[]] * 5  # float noise: never
    assert watch.check({LOGP_DIFF_MEAN: 0.009}) == []  # 90,000x, but below the floor
    watch = MismatchWatch()
    steady = [watch.check({LOGP_DIFF_MEAN: 0.02}) for _ in range(10)]
    assert steady == [[]] * 10
    (jump,) = watch.check({LOGP_DIFF_MEAN: 0.1})
    assert jump.startswith("rollout mismatch jumped") and "5.0x" in jump
    drift = [w for _ in range(10) for w in watch.check({LOGP_DIFF_MEAN: 0.05})]
    assert len(drift) == 1 and "drifts" in drift[0]  # once, when the last 10 steps' median passes 2x the first's
    (cut,) = watch.check({LOGP_DIFF_MEAN: 0.05, OUTSIDE_CAP: 0.03})
    assert "outside the TIS cap" in cut and watch.check({LOGP_DIFF_MEAN: 0.05, OUTSIDE_CAP: 0.03}) == []
    assert "not finite" in watch.check({LOGP_DIFF_MEAN: float("nan")})[0]
    assert watch.check({"loss": 1.0}) == []  # a row without the columns (vLLM off, eval): nothing to say


def test_the_health_monitor_reports_mismatch_warnings(tmp_path):
    from vlmrl.config.schema import HealthConfig
    from vlmrl.train.callbacks import HealthMonitor

    console: list[str] = []
    monitor = HealthMonitor(HealthConfig(), tmp_path / "health.jsonl", console=console.append)
    args = types.SimpleNamespace(num_generations=2, reward_weights=[0.3, 1.0])
    for step, mean in enumerate([0.02, 0.02, 0.02, 0.2], start=1):
        state = types.SimpleNamespace(global_step=step, is_world_process_zero=True)
        monitor.on_log(args, state, TrainerControl(), logs={"loss": 0.1, LOGP_DIFF_MEAN: mean})
    rows = read_jsonl(tmp_path / "health.jsonl")
    assert [len(r["warnings"]) for r in rows] == [0, 0, 0, 1] and "jumped" in rows[-1]["warnings"][0]
    assert console == [f"[health] step 4: {rows[-1]['warnings'][0]}"] and monitor.halted is None


def test_the_report_plots_the_mismatch(tmp_path):
    from vlmrl.common.io import append_jsonl
    from vlmrl.report.files import RunFiles
    from vlmrl.report.sections import training_section

    append_jsonl(tmp_path / "train" / "metrics.jsonl", [
        {"step": s, "loss": 0.1, LOGP_DIFF_MEAN: 0.01 * s, LOGP_DIFF_MAX: 0.1 * s, SEQUENCE_KL: 0.2, OUTSIDE_CAP: 0.0}
        for s in (1, 2)])
    html = training_section(RunFiles(tmp_path))
    assert "rollout vs loss pass: |Δ log p| per token" in html and "KL per completion (k3)" in html
    for key in ("mismatch/logp_diff_*", SEQUENCE_KL, OUTSIDE_CAP):  # mean and max share the first plot
        assert f'data-key="{key}"' in html


def test_the_gpu_script_reads_two_runs_and_a_bench_record(tmp_path):
    """benchmarks/rollout_mismatch.py's bookkeeping on the CPU: run folders as `vlmrl run` leaves them, and a
    bench.json, in; the results JSON (per run, tis minus none paired per item, per-step bench mismatch) out."""
    import importlib.util
    import json
    from pathlib import Path

    from vlmrl.common.io import append_jsonl, write_json_atomic

    spec = importlib.util.spec_from_file_location(
        "rollout_mismatch_script", Path(__file__).resolve().parents[1] / "benchmarks" / "rollout_mismatch.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"device": "H200", "raw": [
        {"path": "plain", "rollout_mismatch": [{"step": 1, LOGP_DIFF_MEAN: 0.01, LOGP_DIFF_MAX: 0.2}]},
        {"path": "vlmrl", "rollout_mismatch": [{"step": 1, LOGP_DIFF_MEAN: 0.02, LOGP_DIFF_MAX: 0.3},
                                                {"step": 2, LOGP_DIFF_MEAN: 0.04, LOGP_DIFF_MAX: 0.5}]}]}))
    args = script.parse_args([str(tmp_path / "out"), "--bench-4bit", str(bench), "train.max_steps=3"])
    assert args.overrides == ["train.max_steps=3"] and args.bench_bf16 is None
    runs = tmp_path / "runs"
    for correction, after in (("tis", [1, 1, 0, 1]), ("none", [1, 0, 0, 1])):  # item b: right with tis only
        run = runs / f"demo-gpu-{correction}"
        for name, correct in (("baseline", [0, 0, 0, 1]), ("after", after), ("after_swapped", [0, 0, 0, 0])):
            append_jsonl(run / f"{name}_records.jsonl", [{"id": i, "correct": bool(c)} for i, c in zip("abcd", correct)])
        write_json_atomic(run / "comparison.json", {
            "metrics": {"accuracy": {"before": 0.25, "after": sum(after) / 4, "delta": sum(after) / 4 - 0.25,
                                     "delta_ci95": [0.1, 0.6]}},
            "visual_control": {"overall": {"visual_gain": 0.5, "visual_gain_ci95": [-0.1, 0.9]}}})
        write_json_atomic(run / "train" / "summary.json", {"rollout_correction": {"correction": correction}})
        append_jsonl(run / "train" / "metrics.jsonl", [{"step": s, "loss": 0.1, LOGP_DIFF_MEAN: 0.01 * s,
                                                        LOGP_DIFF_MAX: 0.1 * s} for s in (1, 2, 3)])
    out = Path(args.out)
    out.mkdir()
    result = script.write_result(out, args, args.overrides, False, runs, {"tis": 0, "none": 0})
    assert json.loads((out / "h200_rollout_mismatch.json").read_text()) == json.loads(json.dumps(result))
    tis = result["runs"]["tis"]
    assert tis["accuracy"]["delta"] == 0.5 and tis["visual_gain_ci95"] == [-0.1, 0.9]
    assert tis["rollout_correction"] == {"correction": "tis"} and len(tis["mismatch_per_step"]) == 3
    assert tis["mismatch_summary"][f"{LOGP_DIFF_MEAN} median"] == pytest.approx(0.02)
    assert tis["mismatch_summary"][f"{LOGP_DIFF_MAX} largest"] == pytest.approx(0.3)
    difference = result["tis_minus_none"]
    assert difference["same_baseline"] is True
    assert difference["after_accuracy"]["tis_minus_none"] == pytest.approx(0.25)  # item b, of 4
    assert difference["after_visual_gap"]["tis_minus_none"] == pytest.approx(0.25)  # nothing right when swapped
    lo, hi = difference["after_accuracy"]["ci95"]
    assert 0 <= lo <= 0.25 <= hi
    assert result["criteria"] == {"tis_accuracy_ci_above_zero": True, "tis_visual_gain_ci_above_zero": False,
                                  "none_accuracy_ci_above_zero": True, "none_visual_gain_ci_above_zero": False,
                                  "tis_costs_no_accuracy": True}
    vlmrl = result["bench"]["4bit"]["paths"]["vlmrl"]["summary"]
    assert vlmrl["steps"] == 2 and vlmrl[f"{LOGP_DIFF_MAX} largest"] == 0.5 and result["bench"]["bf16"] is None
    assert "| tis |" in (out / "h200_rollout_mismatch.md").read_text()
