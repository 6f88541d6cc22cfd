"""Helpers shared by the test files (one copy each; a test file imports them from here, never from another test file).

- The small run: `quick_config` / `quick_args` (a tiny random Qwen3-VL, 40 synthetic items, 6 held out, two
  12-token training steps; `base=` gives another file's settings instead, `extra` changes some), `varied_reward`,
  `copy_run`, `step_rows`.
- The command line: `sets` (`--set` arguments), `invoke` (`vlmrl` in this process), `one_error_line`, `flat`.
- What TRL hands a reward: `reward_batch`.
- Small modules: `Net` and `lora_net` (a two-layer MLP and a trained-looking LoRA on it), `adapted`,
  `AttentionModule`, `fake_trainer`, `Block` and `lora_policy`, `tiny_text_policy`.
- bitsandbytes nf4 layers for the nf4 kernels' tests: `nf4_units`, `nf4_quantized`, `nf4_layer`, `nf4_model`,
  `nf4_rollout_trainer`, `compiled_calls` (bitsandbytes imported when called).
- A fake run folder shaped like the stages' outputs, for the report's tests: `make_run`, `write_json`,
  `write_jsonl`, and the two injection attempts it plants.

Session fixtures built on these (a prepared run, a 2-step trained run) live in tests/conftest.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from PIL import Image, ImageDraw

# --- the small run ------------------------------------------------------------------------------------------

# Every setting the small run changes from the demo preset. The generation batch is 8 (per device x accumulation
# 1 in the demo preset), 4 generations each; eval's 12 tokens matter only where a test evaluates.
QUICK = (
    "model.name=tiny:qwen3_vl", "data.num_synthetic=40", "data.holdout_size=6", "eval.max_new_tokens=12",
    "train.max_completion_length=12", "train.max_steps=2", "train.per_device_train_batch_size=8",
    "train.save_steps=1",
)


def quick_sets(output_dir: Path, *extra: str, base: tuple[str, ...] = QUICK) -> list[str]:
    """`base`'s settings, the run under `output_dir`, then `extra` (a later setting of a field wins)."""
    return [*base, f"run.output_dir={output_dir}", *extra]


def quick_config(output_dir: Path, *extra: str, base: tuple[str, ...] = QUICK):
    """The demo preset with `quick_sets`: the small run as a Config."""
    from vlmrl.config.schema import load_config

    return load_config("demo", quick_sets(output_dir, *extra, base=base))


def quick_args(output_dir: Path, *extra: str, base: tuple[str, ...] = QUICK, command: str = "run") -> list[str]:
    """The same run as `vlmrl` arguments: `COMMAND demo --set ... --set ...`."""
    return [command, "demo", *sets(*quick_sets(output_dir, *extra, base=base))]


def varied_reward(completions, answer, **kwargs) -> list[float]:
    """Stands in for correctness_reward, which a random model never earns: 0..2 by completion length in characters,
    so a group of 4 rarely ties and the advantages are not all zero (deterministic, so a failure repeats)."""
    from vlmrl.contract import completion_text

    return [(len(completion_text(c) or "") % 5) / 2 for c in completions]


varied_reward.__name__ = "correctness_reward"  # TRL names the reward column after the function


def copy_run(source: Path, output_dir: Path) -> Path:
    """A copy of a run folder under output_dir/<its name>, so a config with run.output_dir=output_dir finds it."""
    target = output_dir / source.name
    shutil.copytree(source, target, symlinks=True)
    return target


def step_rows(path: Path) -> list[dict]:
    """metrics.jsonl rows of optimizer steps (the end-of-training summary row has train_runtime instead)."""
    from vlmrl.common.io import read_jsonl

    return [r for r in read_jsonl(path) if "train_runtime" not in r]


# --- the command line ---------------------------------------------------------------------------------------


def sets(*items: str) -> list[str]:
    """`--set ITEM` for each item."""
    return [a for s in items for a in ("--set", s)]


def invoke(*args: str):
    """`vlmrl ARGS` in this process (typer's CliRunner), on a 300-column console."""
    from typer.testing import CliRunner

    from vlmrl.cli.app import app

    return CliRunner().invoke(app, list(args), terminal_width=300)


def one_error_line(output: str) -> str:
    """The one `error:` line of a command's output (and no traceback)."""
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


def flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines at the console width


# --- rewards ------------------------------------------------------------------------------------------------


def reward_batch(n: int = 3, *, log_extra: bool = False) -> dict:
    """What TRL hands a reward: conversational completions, prompts, and one column value per completion
    (and, with `log_extra`, TRL's `log_extra` callback, here one that does nothing)."""
    batch = {
        "prompts": [[{"role": "user", "content": [{"type": "text", "text": f"question {i}"}]}] for i in range(n)],
        "completions": [[{"role": "assistant", "content": f"<SOLUTION>{i}</SOLUTION>"}] for i in range(n)],
        "answer": [str(i) for i in range(n)],
        "id": [f"item-{i}" for i in range(n)],
    }
    if log_extra:
        batch["log_extra"] = lambda *args: None
    return batch


# --- small modules ------------------------------------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def lora_net(dtype: torch.dtype, **lora_kwargs) -> torch.nn.Module:
    """`Net` in `dtype` with an r=8 LoRA on both layers whose B is non-zero (a trained adapter)."""
    from peft import LoraConfig, get_peft_model

    from vlmrl.engine.lora_layers import lora_layers

    torch.manual_seed(0)
    model = get_peft_model(Net().to(dtype), LoraConfig(r=8, lora_alpha=16, target_modules=["up", "down"],
                                                       **lora_kwargs))
    for layer in lora_layers(model):  # a trained adapter: B is zero at initialisation
        for b in layer.lora_B.values():
            torch.nn.init.normal_(b.weight, std=0.05)
    return model


def adapted(seed: int = 0):
    """A bf16 `Net(32)` with peft's default float32 r=4 LoRA, B non-zero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(Net(32).to(torch.bfloat16), LoraConfig(r=4, target_modules=["up", "down"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}  # peft's default
    return model


class AttentionModule(torch.nn.Module):
    """What the attention functions read of a model's attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def fake_trainer(model, rollout, **extra):
    """What `enable_fast_generation` reads of a built bf16 `GRPOTrainer`, with `rollout` as TRL's generate call."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    return SimpleNamespace(generation_config=GenerationConfig(), generation_kwargs={}, model=model,
                           args=SimpleNamespace(bf16=True, fp16=False), _generate_single_turn=rollout, **extra)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_policy(model, **lora):
    """`model` with an r=4 LoRA on the language projections (LORA_TARGETS), B non-zero (a trained adapter)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, **lora))
    with torch.no_grad():  # a trained adapter: B is zero at initialisation
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    return policy


class Block(torch.nn.Module):
    """q/k/v with biases (as Qwen2.5-VL's), gate/up, and an o_proj that reads something else."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.q_proj = torch.nn.Linear(width, width)
        self.k_proj = torch.nn.Linear(width, width // 2)
        self.v_proj = torch.nn.Linear(width, width // 2)
        self.o_proj = torch.nn.Linear(width, width, bias=False)
        self.gate_proj = torch.nn.Linear(width, 2 * width, bias=False)
        self.up_proj = torch.nn.Linear(width, 2 * width, bias=False)

    def forward(self, x, y):
        return (self.q_proj(x), self.k_proj(y), self.v_proj(x), self.o_proj(x),
                self.gate_proj(y), self.up_proj(y), self.gate_proj(x))


def tiny_text_policy():
    """A 2-layer Qwen3 with a ~20-token word-level vocabulary, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    sentences = ["What is 2 + 2 ?", "How many squares are there ?", "addCriterion 4 3 answer"]
    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(
        sentences, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[EOS]", "[UNK]"])
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return Qwen3ForCausalLM(config), tokenizer


# --- nf4 layers (bitsandbytes) -------------------------------------------------------------------------

NF4_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the nf4 tests run


def nf4_units(got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """|got - expected| in units in the last place of their dtype at max(|expected|, 2^(mantissa - 19) * scale),
    `scale` the sum of |x * w| of each output: 2^-12 of it in bf16, 2^-9 in fp16 (3 more mantissa bits). Below that
    the fp32 sum's own rounding, in any order, is a good part of a unit: it grows with `scale` (about 2^-24 of it),
    not with the output, so the floor is the same 2^-19 of `scale` in units of either dtype."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[got.dtype]
    at = torch.maximum(expected.float().abs(), scale * 2.0 ** (mantissa - 19))
    unit = torch.ldexp(torch.ones_like(at), torch.frexp(at).exponent - 1 - mantissa)
    return (got.float() - expected.float()).abs() / unit.clamp(min=torch.finfo(got.dtype).smallest_normal
                                                                * 2.0 ** -mantissa)


def nf4_quantized(n, k, weight_dtype=torch.bfloat16, nested=True, blocksize=64, seed=0):
    """A random (n, k) weight quantized by bitsandbytes to nf4: (packed, quant state)."""
    from bitsandbytes import functional as BF

    torch.manual_seed(seed)
    weight = (torch.randn(n, k) * 0.05).to(weight_dtype).to(NF4_DEVICE)
    return BF.quantize_4bit(weight, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")


def nf4_layer(k, n, bias=True, quant_type="nf4", dtype=torch.bfloat16, seed=0):
    """A bitsandbytes Linear4bit k -> n with random weights (and bias), on NF4_DEVICE."""
    import bitsandbytes as bnb

    torch.manual_seed(seed)
    layer = bnb.nn.Linear4bit(k, n, bias=bias, compute_dtype=dtype, quant_type=quant_type)
    layer.weight = bnb.nn.Params4bit((torch.randn(n, k) * 0.05).to(dtype), requires_grad=False,
                                     quant_type=quant_type, blocksize=64)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(n).to(dtype), requires_grad=False)
    # on a CPU with AVX512-BF16 bitsandbytes repacks the weights for its own kernel at the first eval forward
    layer.support_avx512bf16_for_cpu = False
    return layer.to(NF4_DEVICE)


def nf4_model(*layers):
    return torch.nn.Sequential(*layers).eval()


def nf4_rollout_trainer(model, step):
    """A `fake_trainer` whose rollout is `model(step)` without gradients."""

    def rollout():
        with torch.no_grad():
            return model(step)

    return fake_trainer(model, rollout)


def nf4_block_with_expected():
    """`nf4_block()`, two inputs on NF4_DEVICE, the bf16 autocast rollouts run under, and PEFT's forwards over the nf4
    kernel with the bf16 adapter copies on them: (block, x, y, autocast, expected)."""
    from vlmrl.engine.rollout import nf4
    from vlmrl.engine.rollout.adapter_cast import LowPrecisionAdapters

    block = nf4_block()
    torch.manual_seed(2)
    x, y = (torch.randn(4, 5, 64, dtype=torch.bfloat16, device=NF4_DEVICE) for _ in range(2))
    autocast = torch.autocast(torch.device(NF4_DEVICE).type, dtype=torch.bfloat16, cache_enabled=False)
    with torch.no_grad(), autocast, nf4.nf4_decode(block), LowPrecisionAdapters(block, torch.bfloat16).active():
        expected = block(x, y)
    return block, x, y, autocast, expected


def compiled_calls(module, *args):
    """`module(*args)` compiled in one graph (dynamo reset first), and the functions its graph calls."""
    nodes = []

    def backend(gm, example_inputs):
        nodes.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(module, backend=backend, fullgraph=True)(*args), nodes


# --- a fake run folder (the report's tests) -----------------------------------------------------------------

SCRIPT_ATTACK = "<script>window.__pwned=1</script>"
IMG_ATTACK = '<img src=x onerror="window.__pwned=1">'
ALL_STAGES = ("setup", "data", "baseline", "train", "after", "compare", "export")


def make_run(root: Path, *, n: int = 12, stages: tuple[str, ...] = ALL_STAGES) -> Path:
    """The files a run directory holds after `stages`. Item 1's after completion is an injection attempt."""
    run = root / "run"
    (run / "data" / "images").mkdir(parents=True, exist_ok=True)
    items = [_item(run, i) for i in range(n)]
    if "setup" in stages:
        (run / "config.yaml").write_text("run:\n  name: demo\n  seed: 0\ntrain:\n  algorithm: gspo\n")
        write_json(run / "env.json", {"python": "3.11.2", "packages": {"torch": "2.14.1", "trl": "1.16.0"},
                                      "cuda": {"available": False, "devices": []},
                                      "backends": {"unsloth": False, "vllm": False}, "disk_free_gib": 74.2})
    if "data" in stages:
        write_jsonl(run / "data" / "holdout.jsonl", items)
        write_json(run / "data" / "summary.json", {
            "input_rows": n + 43, "train": 40, "holdout": n,
            "dropped_by_reason": {"too_long": 2, "bad_image": 1}, "comparable_to_published": False,
            "message": "synthetic data"})
    records = {}
    for stage in ("baseline", "after"):
        if stage in stages:
            records[stage] = [_record(item, stage) for item in items]
            write_jsonl(run / f"{stage}_records.jsonl", records[stage])
            write_json(run / f"{stage}_summary.json", _summary(stage, records[stage]))
    if "train" in stages:
        write_jsonl(run / "train" / "metrics.jsonl", [_metrics(s) for s in range(1, 21)])
        write_jsonl(run / "train" / "health.jsonl", [
            {"step": s, "n": 4, "gibberish_rate": 0.0, "format_rate": min(1, 0.1 * s), "truncation_rate": 0.1,
             "mean_length": 60 - s, "zero_variance_groups": 1, "reward_mean": 0.3, "reward_std": 0.1,
             "warnings": ["format rate < 0.5 <b>"] if s == 2 else []} for s in range(1, 21)])
        write_json(run / "train" / "summary.json", {"algorithm": "gspo", "steps": 20, "optimizer": "adamw_torch",
                                                    "train_seconds": 12.5, "lora": {"r": 16, "alpha": 16}})
    if "compare" in stages:
        write_json(run / "comparison.json", _comparison(records["baseline"], records["after"]))
    if "export" in stages:
        write_json(run / "export.json", {"adapter_dir": "adapter", "source": "train/final", "base_model": "tiny",
                                         "all_passed": False, "checks": [
            {"name": "lora_b_nonzero", "passed": True, "value": 14, "detail": ""},
            {"name": "logits_match", "passed": False, "value": 0.02, "detail": "max diff"},
            {"name": "gguf", "passed": None, "value": None, "detail": "no llama.cpp"}]})
    return run


def _item(run: Path, i: int) -> dict:
    image = Image.new("RGB", (256, 256), "white")
    ImageDraw.Draw(image).rectangle([40, 256 - 20 * (i % 10 + 1), 120, 250], fill=(60, 110, 200))
    image.save(run / "data" / "images" / f"q{i}.png")
    return {"id": f"item-{i:03d}", "question": f"How tall is bar {i}? (<b>units</b>)", "prompt": "...",
            "answer": str(i % 10 + 1), "answer_type": "integer", "precision": None, "unit": None,
            "choices": None, "source": "synthetic", "category": ["chart", "geometry"][i % 2], "metadata": {},
            "image": f"data/images/q{i}.png", "image_sha256": "ab" * 32}


def _record(item: dict, stage: str) -> dict:
    i = int(item["id"].split("-")[1])
    good = (i % 3 == 0) if stage == "baseline" else (i % 2 == 0)  # some gained, some lost, some unchanged
    formatted = stage == "after" or i % 4 != 1
    answer = item["answer"] if good else "0"
    completion = "the bar is tall"
    if formatted:
        completion = f"<REASONING>count</REASONING><SOLUTION>{answer}</SOLUTION>"
    if stage == "after" and i == 1:  # an injection attempt, and the only broken format after training
        completion, formatted = f"{SCRIPT_ATTACK} {IMG_ATTACK} <SOLUTION>0</SOLUTION>", False
    correct = good and formatted
    return {"id": item["id"], "stage": stage, "question": item["question"], "gold": item["answer"],
            "answer_type": "integer", "precision": None, "completion": completion,
            "pred": answer if formatted else None, "format_ok": formatted,
            "format_reward": 1.0 if formatted else 0.0, "correctness_reward": 1.0 if correct else 0.0,
            "total_reward": 0.3 * formatted + 1.0 * correct, "correct": correct, "exact_match": correct,
            "degenerate": False, "mathvista_normalized": None, "mathvista_correct": correct,
            "generated_tokens": 17, "truncated": False, "image_sha256": item["image_sha256"],
            "prompt_sha256": "cd" * 32, "category": item["category"], "metadata": {}, "generation": {},
            "seconds": 0.1}


def _metrics(step: int) -> dict:
    return {"step": step, "epoch": step / 20, "reward": 0.2 + 0.03 * step,
            "rewards/format_reward/mean": min(1, 0.1 * step), "rewards/correctness_reward/mean": 0.02 * step,
            "completions/mean_length": 60 - step, "completions/clipped_ratio": 0.1,
            "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.01 * (step % 3),
            "frac_reward_zero_std": 0.5 - 0.02 * step,
            "learning_rate": 5e-6, "loss": 0.01 * (step % 4), "grad_norm": 0.3}


def _mean(rows: list[dict], field: str) -> float:
    return sum(float(r[field]) for r in rows) / len(rows)


def _summary(stage: str, records: list[dict]) -> dict:
    def stat(field):
        mean = _mean(records, field)
        return {"mean": mean, "ci95": [max(0.0, mean - 0.1), mean + 0.1]}

    return {"stage": stage, "n": len(records), "accuracy": stat("correct"),
            "mathvista_accuracy": stat("mathvista_correct"), "exact_match": stat("exact_match"),
            "format_compliance": stat("format_ok"), "format_reward": stat("format_reward"),
            "correctness_reward": stat("correctness_reward"), "total_reward": stat("total_reward"),
            "truncation_rate": 0.0, "gibberish_rate": 0.0, "mean_generated_tokens": 17.0,
            "tokens_per_second": 123.4, "items_per_second": 7.25}


def _comparison(before: list[dict], after: list[dict]) -> dict:
    pairs = list(zip(before, after, strict=True))
    metrics = {}
    for name, field in (("accuracy", "correct"), ("mathvista_accuracy", "mathvista_correct"),
                        ("format_compliance", "format_ok")):
        b, a = _mean(before, field), _mean(after, field)
        metrics[name] = {"before": b, "after": a, "delta": a - b, "delta_ci95": [a - b - 0.21, a - b + 0.19],
                         "gained": sum(not x[field] and y[field] for x, y in pairs),
                         "lost": sum(x[field] and not y[field] for x, y in pairs), "mcnemar_p": 0.0421875}
    for name in ("total_reward", "format_reward", "correctness_reward"):
        b, a = _mean(before, name), _mean(after, name)
        metrics[name] = {"before": b, "after": a, "delta": a - b, "delta_ci95": [a - b - 0.1, a - b + 0.1]}
    flips = {"wrong_to_right": [x["id"] for x, y in pairs if not x["correct"] and y["correct"]],
             "right_to_wrong": [x["id"] for x, y in pairs if x["correct"] and not y["correct"]],
             "format_broken_to_ok": [x["id"] for x, y in pairs if not x["format_ok"] and y["format_ok"]],
             "format_ok_to_broken": [x["id"] for x, y in pairs if x["format_ok"] and not y["format_ok"]]}
    regressions = sorted(((y["total_reward"] - x["total_reward"], x, y) for x, y in pairs),
                         key=lambda t: t[0])
    by_category = {}
    for cat in sorted({x["category"] for x in before}):
        bs, as_ = ([r for r in rs if r["category"] == cat] for rs in (before, after))
        by_category[cat] = {"n": len(bs), "accuracy_before": _mean(bs, "correct"),
                            "accuracy_after": _mean(as_, "correct"), "format_before": _mean(bs, "format_ok"),
                            "format_after": _mean(as_, "format_ok")}
    return {"n_paired": len(pairs), "ids_missing_a_pair": [], "metrics": metrics,
            "flip_counts": {k: len(v) for k, v in flips.items()}, "flips": flips,
            "largest_regressions": [
                {"id": x["id"], "before": x["total_reward"], "after": y["total_reward"], "delta": d}
                for d, x, y in regressions if d < 0],
            "by_category": by_category}


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def nf4_block():
    """`Block(64)` with bitsandbytes nf4 base layers (the kernel's smallest block is 64 inputs) and a LoRA on each
    (k of rank 2, v with its own alpha)."""
    block = Block(64)
    for seed, name in enumerate(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")):
        linear = getattr(block, name)
        setattr(block, name, nf4_layer(64, linear.out_features, bias=linear.bias is not None, seed=seed))
    return lora_policy(block, rank_pattern={"k_proj": 2}, alpha_pattern={"v_proj": 2}).requires_grad_(False)
