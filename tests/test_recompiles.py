"""A function dynamo stops recompiling (and so runs eagerly from then on) is caught, said by the rollouts and marked
in the bench's table (`vlmrl.engine.recompiles`)."""

from __future__ import annotations

import logging

import torch

from tests.helpers import Block, fake_trainer, lora_policy
from vlmrl.engine.recompiles import recompile_limit_hits, trainer_hits


def _growing_calls(calls: int = 4) -> None:
    """A compiled step that meets a new shape at every call, as a token step did on transformers before 5.23."""
    step = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        for n in range(1, calls + 1):
            step(torch.ones(n))


def test_a_recompile_limit_hit_is_caught_inside_the_block_only():
    torch._dynamo.reset()
    with recompile_limit_hits() as hits:
        _growing_calls()
    assert len(hits) == 1 and hits[0].limit == "recompile_limit"
    assert "<lambda>" in hits[0].function and "size mismatch" in hits[0].reason
    torch._dynamo.reset()
    _growing_calls()  # outside: nothing more is collected
    assert len(hits) == 1
    torch._dynamo.reset()
    with recompile_limit_hits() as none:
        _growing_calls(calls=2)  # within the limit
    assert none == []


def test_rollouts_say_it_once_and_keep_it_on_the_trainer(caplog):
    from vlmrl.engine.rollout.fast import enable_fast_generation

    torch._dynamo.reset()
    trainer = fake_trainer(lora_policy(Block(64).to(torch.bfloat16)), _growing_calls)
    enable_fast_generation(trainer, kernels=False)
    assert {"recompiles", "step_inputs"} <= set(dict(trainer.vlmrl_rollout_contexts))
    with caplog.at_level(logging.WARNING, logger="vlmrl.engine.recompiles"):
        trainer._generate_single_turn()
    said = [r.getMessage() for r in caplog.records if r.name == "vlmrl.engine.recompiles"]
    assert len(said) == 1 and "runs it eagerly" in said[0] and "TORCH_LOGS=recompiles" in said[0]
    assert [hit.limit for hit in trainer.vlmrl_recompile_limit_hits] == ["recompile_limit"]
    listed = trainer_hits(trainer)  # what train/summary.json's recompile_limit_hits holds
    assert [h["limit"] for h in listed] == ["recompile_limit"] and "<lambda>" in listed[0]["function"]
    assert trainer_hits(fake_trainer(lora_policy(Block(64)), _growing_calls)) == []  # no rollout, no hit


def test_the_bench_table_marks_a_path_that_ran_eagerly_after_a_hit():
    from tests.test_bench_throughput import _result
    from vlmrl.bench import BenchSettings, load_shapes, markdown_table, summarize

    settings = BenchSettings(steps=1, paths=["vlmrl"])
    hit = {"limit": "recompile_limit", "function": "'forward' (m.py:1)", "reason": "0/7: tensor 'ids' size mismatch"}
    clean = _result("vlmrl", [(60.0, 50.0)], 20.0)
    ceilings = {"matmul_tflops": 800, "copy_bandwidth_tbs": 4.0}
    summary = summarize(settings, load_shapes("qwen3_vl_8b"), ceilings, [clean | {"recompile_limit_hits": [hit]}], 310)
    assert summary["paths"]["vlmrl"]["recompile_limit_hits"] == [hit]
    assert ("**vlmrl: dynamo hit its recompile_limit compiling `'forward' (m.py:1)` and ran it eagerly after that** "
            "(last recompile: `0/7: tensor 'ids' size mismatch`)") in markdown_table(summary)
    assert "ran it eagerly" not in markdown_table(summarize(settings, load_shapes("qwen3_vl_8b"), ceilings, [clean], 310))
