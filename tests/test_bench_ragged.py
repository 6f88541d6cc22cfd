"""The bench's ragged workload: the drawn lengths, their forcing inside a real `generate`, and the figures over them."""

from __future__ import annotations

import statistics
import types

import pytest
import torch
from typer.testing import CliRunner

from vlmrl.bench import BenchSettings, decode_floor_ms, load_shapes, markdown_table, summarize
from vlmrl.bench.ragged import draw_lengths, force_lengths
from vlmrl.bench.summary import completion_lengths
from vlmrl.cli.app import app
from vlmrl.engine.rollout.sampling import enable_sampler_logprobs

EOS, PAD = 3, 0


def test_lengths_have_the_stated_median_and_a_tenth_at_the_cap_and_repeat():
    many = draw_lengths(20000, 600, 4096)
    assert statistics.median(many) == pytest.approx(600, rel=0.05)
    assert sum(n == 4096 for n in many) / len(many) == pytest.approx(0.1, abs=0.01)
    assert min(many) >= 1 and max(many) == 4096
    assert draw_lengths(32, 600, 4096) == draw_lengths(32, 600, 4096) != draw_lengths(32, 600, 4096, seed=1)
    with pytest.raises(ValueError, match="below the cap"):
        draw_lengths(4, 4096, 4096)


def _trainer(model):
    """What the wrappers read of a GRPOTrainer, its rollout TRL's transformers path: sample, cut at the first end
    token (kept), no log-probs."""

    def trls(prompt_ids, images, multimodal_fields, num_generations):
        prompt = torch.tensor(prompt_ids)
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                             max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD)
        completions = []
        for row in out[:, prompt.shape[1]:].tolist():
            completions.append(row[: row.index(EOS) + 1] if EOS in row else row)
        return completions, None

    return types.SimpleNamespace(temperature=1.0, model_wrapped=model, _generate_single_turn=trls, eos_token_ids=[EOS],
                                 accelerator=types.SimpleNamespace(unwrap_model=lambda m: m))


def test_a_real_generate_ends_each_row_at_its_drawn_length_and_the_recorder_sees_the_model_s_logits():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=EOS,
                                         pad_token_id=PAD)).eval()
    trainer = _trainer(model)
    enable_sampler_logprobs(trainer)
    force_lengths(trainer, median=4, cap=12)  # after the recorder, as the bench installs it
    completions, logprobs = trainer._generate_single_turn([[5, 6, 7]] * 6, None, {}, 6)
    drawn = draw_lengths(6, 4, 12)
    assert [len(c) for c in completions] == drawn and len(set(drawn)) > 1
    assert all(c[-1] == EOS and EOS not in c[:-1] for c in completions)
    # the forced end token is recorded at its probability under the model (as the loss pass computes it), not 1
    assert all(-8 < row[-1] < -0.5 for row in logprobs)
    assert "generate" not in vars(model)  # the wrappers leave the model as it was


def _raw(path, steps, lengths):
    return {"path": path, "error": None, "fast_generation": None, "peak_memory_gib": 10.0, "peak_reserved_gib": 10.0,
            "steps": [{"seconds": s, "generate_seconds": g, "rollout_lengths": lengths} for s, g in steps]}


def test_ragged_figures_count_token_steps_and_the_rows_still_generating():
    shapes, ceilings = load_shapes("qwen3_vl_8b"), {"matmul_tflops": 800, "copy_bandwidth_tbs": 4.0}
    settings = BenchSettings(steps=2, completion=4096, ragged_median=600)
    lengths = completion_lengths(settings)
    assert lengths == draw_lengths(32, 600, 4096) and max(lengths) == 4096
    results = [_raw("plain", [(400, 380)], [lengths]), _raw("vlmrl", [(90, 80), (40, 30)], [lengths[:-1] + [7]])]
    s = summarize(settings, shapes, ceilings, results, prompt_tokens=300)
    floors, fast = s["floors"], s["paths"]["vlmrl"]
    assert fast["decode_ms_per_step"] == pytest.approx(30e3 / 4096)  # per token step of the longest row
    assert fast["decode_tokens_per_second"] == pytest.approx(sum(lengths) / 30)
    # the rows that ended are not read by the floor; reading them all is the forced floor at 4096 steps
    assert floors["decode_ms_per_step"] < floors["decode_ms_per_step_all_rows"]
    assert floors["decode_ms_per_step_all_rows"] == pytest.approx(
        decode_floor_ms(s["language_params"] * 2, 147456, 32, 300, 4096, 4e12), rel=0.02)
    assert s["ragged"]["useful_fraction"] == pytest.approx(sum(lengths) / (32 * 4096))
    assert (s["paths"]["plain"]["lengths_as_drawn"], fast["lengths_as_drawn"]) == (True, False)
    table = markdown_table(s)
    assert "completions ragged (median 600, a tenth at the 4096-token cap" in table
    assert "Completions ended at the drawn lengths: plain yes, vlmrl no." in table
    forced = summarize(BenchSettings(steps=2), shapes, ceilings, results, prompt_tokens=300)
    assert forced["ragged"] is None and forced["paths"]["vlmrl"]["lengths_as_drawn"] is None
    assert "completion 1024 tokens (forced)" in markdown_table(forced)


@pytest.mark.parametrize("args, message", [
    (["--ragged-median", "1024"], "--ragged-median 1024: give a median of at least 1 and below --completion (1024)"),
    (["--ragged-median", "600", "--generation-batches", "32"], "--generation-batches forces full-length"),
    (["--ragged-median", "600", "--completion", "4096"], "needs a CUDA GPU"),  # taken; then no GPU here
])
def test_the_cli_takes_a_ragged_median_below_the_cap_in_one_line(args, message):
    result = CliRunner().invoke(app, ["bench", "--paths", "vlmrl", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_the_modules_examples_hold():
    import doctest

    from vlmrl.bench import floors, ragged

    assert [doctest.testmod(m).failed for m in (ragged, floors)] == [0, 0]
    assert doctest.testmod(ragged).attempted >= 2
