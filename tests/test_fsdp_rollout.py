"""Rollouts under FSDP2 (docs/multi_gpu.md, "Rollouts under sharding"), checked with two gloo processes on the CPU:
a tiny Qwen3-VL with a LoRA adapter, wrapped by accelerate's own FSDP2 preparation (`fsdp2_prepare_model`, as
`--strategy fsdp` runs it; accelerate leaves FSDP off on the CPU, so it is called directly), generates through
`PeftModel.generate` as TRL does. Inside `vlmrl.engine.rollout.sharded.root_gathered` it gives the unsharded
model's greedy tokens, before and after training steps; each rank holds about half the parameters; every decoder
block runs, gathered, at every token step; transformers sees an FSDP-managed model (so `generate` keeps the ranks'
decode loops in step). Without the root gathered the first rollout fails at the vision tower. The compiled decode
under FSDP2 is a GPU question (the plan's FSDP rows)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = r'''
import sys, types, torch, torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from peft import LoraConfig, get_peft_model
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.distributed.fsdp import is_fsdp_managed_module
from vlmrl.engine.rollout.sharded import root_gathered

dist.init_process_group("gloo")
model = AutoModelForImageTextToText.from_pretrained(sys.argv[1], dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"))
processor = AutoProcessor.from_pretrained(sys.argv[1])
chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many squares?"}]}]
inputs = processor(text=[processor.apply_chat_template(chat, add_generation_prompt=True)],
                   images=[Image.new("RGB", (64, 64), "white")], return_tensors="pt")
new = 6
generate = lambda: model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
model.eval()
with torch.no_grad():
    reference = generate()
plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                        reshard_after_forward=True)
accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no",
                                    is_main_process=dist.get_rank() == 0, device=torch.device("cpu"))
model = fsdp2_prepare_model(accelerator, model)
local = sum(p.to_local().numel() for p in model.parameters())
total = sum(p.numel() for p in model.parameters())
runs = {}
for name, module in model.named_modules():
    if type(module).__name__.startswith("FSDP") and name.endswith(tuple(f"layers.{i}" for i in range(64))):
        module.register_forward_pre_hook(lambda m, a, n=name: runs.__setitem__(n, runs.get(n, 0) + 1))
same, per_rollout = [], []
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)  # weights stay put
for _ in range(2):
    runs.clear()
    with torch.no_grad(), root_gathered(model):
        same.append(torch.equal(generate(), reference))
    per_rollout.append(sorted(set(runs.values())))
    model.train()
    model(**inputs, labels=inputs["input_ids"]).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()
with open(f"{sys.argv[2]}/rank{dist.get_rank()}", "w") as out:
    out.write(f"{all(same)} {local} {total} {per_rollout[0]}{per_rollout[1]} {len(runs)} {is_fsdp_managed_module(model)}")
dist.destroy_process_group()
'''


def _launch(script: Path, model: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script),
                           str(model), str(out)], capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow  # ~10 s: two gloo processes
def test_fsdp2_rollouts_gather_block_by_block_and_match_one_process(tmp_path: Path):
    from vlmrl.models.tiny import build_tiny_model

    model = build_tiny_model("qwen3_vl", tmp_path / "tiny")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    done = _launch(script, model, tmp_path)
    results = [f.read_text().split() for f in sorted(tmp_path.glob("rank*"))]
    assert done.returncode == 0 and len(results) == 2, done.stdout[-3000:] + done.stderr[-3000:]
    for same, local, total, runs, blocks, managed in results:
        assert same == "True"  # the sharded model's greedy tokens are the unsharded model's, rollout after rollout
        assert 0.45 < int(local) / int(total) < 0.55  # each rank holds about half
        # every decoder block ran once per forward: the prompt pass and each of the 5 later token steps
        assert runs == "[6][6]" and int(blocks) >= 2
        assert managed == "True"  # transformers then runs generate with synced_gpus


@pytest.mark.slow  # ~10 s: two gloo processes
def test_without_the_root_gathered_the_first_rollout_fails(tmp_path: Path):
    """Why vlmrl wraps TRL's rollouts under FSDP (`vlmrl.engine.rollout.sharded.gather_root_in_rollouts`)."""
    from vlmrl.models.tiny import build_tiny_model

    model = build_tiny_model("qwen3_vl", tmp_path / "tiny")
    script = tmp_path / "worker.py"
    script.write_text(WORKER.replace("torch.no_grad(), root_gathered(model)", "torch.no_grad()"))
    done = _launch(script, model, tmp_path)
    assert done.returncode != 0 and "mixed torch.Tensor and DTensor" in done.stdout + done.stderr


def test_the_wrapper_is_installed_under_fsdp_only_and_stays_innermost_once():
    """Installed before the fast path, which wraps it (and re-wraps, as experiments do, without nesting twice)."""
    import contextlib
    from types import SimpleNamespace

    from vlmrl.engine.rollout.fast import wrap_rollouts
    from vlmrl.engine.rollout.sharded import gather_root_in_rollouts

    calls: list[str] = []
    plain = SimpleNamespace(is_fsdp_enabled=False, _generate_single_turn=lambda x: calls.append(x) or x)
    assert gather_root_in_rollouts(plain) is False and plain._generate_single_turn("a") == "a"

    def context(name):
        @contextlib.contextmanager
        def entered():
            calls.append(name)
            yield
        return entered

    trainer = SimpleNamespace(is_fsdp_enabled=True, model_wrapped=object(),  # not an FSDP module: nothing gathered
                              _generate_single_turn=lambda x: calls.append(x) or x)
    assert gather_root_in_rollouts(trainer) is True
    wrap_rollouts(trainer, [("fast", context("fast"))])
    wrap_rollouts(trainer, [("fast", context("fast")), ("experiment", context("experiment"))])
    calls.clear()
    assert trainer._generate_single_turn("b") == "b" and calls == ["fast", "experiment", "b"]
