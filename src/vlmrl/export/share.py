"""Stage 8, sharing: make `adapter/` and each merged folder loadable by someone without vlmrl or this machine.

Each folder gets the processor (tokenizer, chat template, image processor), so `AutoProcessor.from_pretrained`
works on the folder alone, and a model card (`README.md`) with the base model, the recipe, the held-out
before/after table with its intervals (from `comparison.json`), the dataset and its contamination check (from
`data/summary.json`) and load snippets. The adapter names its base by the hub id or the path the user gave;
`tiny:<arch>` and `demo-policy` bases exist on no hub, so their (few-MB) weights are copied into
`adapter/base-model/` and the adapter records that relative folder. `push_folder` uploads through
`huggingface_hub`. Left out: dataset cards, and uploading the run's records.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from vlmrl.common.stats import finite
from vlmrl.config.schema import Config
from vlmrl.models.loading import is_local_only
from vlmrl.run import layout

LOCAL_BASE = "base-model"  # inside adapter/, for bases no hub hosts
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def shareable_base_name(config: Config, adapter_dir: Path, resolved_source: str) -> str:
    """Rewrite adapter_config.json's base model to a name others can load; copy a vlmrl-built base in."""
    name = config.model.name
    if is_local_only(name):
        target = adapter_dir / LOCAL_BASE
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(resolved_source, target, ignore=shutil.ignore_patterns("demo_policy.json", ".*"))
        name = LOCAL_BASE
    path = adapter_dir / "adapter_config.json"
    adapter_config = json.loads(path.read_text())
    adapter_config["base_model_name_or_path"] = name
    path.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    return name


def save_processor(processor: Any, folder: Path) -> None:
    processor.save_pretrained(str(folder))


def write_model_card(folder: Path, config: Config, run_dir: Path, *, kind: str, base_name: str) -> Path:
    """`README.md` in `folder`; `kind` is "adapter", "merged-16bit" or "merged-4bit"."""
    sections = [
        _front_matter(base_name, kind, config),
        f"# {config.run.name}: {config.train.algorithm.upper()} LoRA on {base_name} ({kind})\n",
        (f"Trained with vlmrl (GRPO/GSPO through TRL) from {_base_model(config, base_name)} on "
         f"{_data_source(config.data.source)}.\n"),
        _recipe(config, base_name),
        _results(run_dir),
        _dataset(run_dir),
        _usage(kind, base_name),
    ]
    path = folder / "README.md"
    path.write_text("\n".join(s for s in sections if s))
    return path


def _front_matter(base_name: str, kind: str, config: Config) -> str:
    lines = ["---", "library_name: " + ("peft" if kind == "adapter" else "transformers"),
             "pipeline_tag: image-text-to-text", "tags: [vlmrl, " + config.train.algorithm + ", lora, trl]"]
    if base_name != LOCAL_BASE:
        lines.append(f"base_model: {base_name}")
    return "\n".join([*lines, "---", ""])


def _recipe(config: Config, base_name: str) -> str:
    t, lora = config.train, config.lora
    rows = [
        ("base model", _base_model(config, base_name)),
        ("data", _data_source(config.data.source)),
        ("answer form", f"contract `{config.contract}` (vlmrl.contract)"),
        ("base weights", "nf4 (bitsandbytes 4-bit)" if config.model.load_in_4bit else config.model.dtype),
        ("algorithm", f"{t.algorithm} (loss {t.loss_type}), {t.num_generations} completions per prompt"),
        ("LoRA", f"r={lora.r}, alpha={lora.alpha}, attention={lora.attention}, mlp={lora.mlp}, vision={lora.vision}"),
        ("optimizer", f"{t.optim}, learning rate {t.learning_rate}, {t.trl_value('lr_scheduler_type')}"),
        ("length", f"max_steps={t.max_steps}, max_completion_length={t.max_completion_length}"),
        ("rewards", ", ".join(f"{r.name or r.function} x {r.weight:g}" for r in config.rewards)),
    ]
    return "## Recipe\n\n| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def _results(run_dir: Path) -> str:
    path = run_dir / layout.COMPARISON
    if not path.is_file():
        return "## Held-out results\n\nNo comparison.json in the run (run `vlmrl compare`): no before/after figures.\n"
    comparison = json.loads(path.read_text())
    lines = [f"## Held-out results ({comparison['n_paired']} paired items)\n",
             "| metric | before | after | delta | 95% CI of delta |", "|---|---|---|---|---|"]
    for name, m in comparison["metrics"].items():
        if not all(finite(m.get(key)) for key in ("before", "after", "delta")):  # a reward that never scored
            lines.append(f"| {name} | no values | | | |")
            continue
        ci = m.get("delta_ci95") or []
        shown = f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" if len(ci) == 2 and all(map(finite, ci)) else "–"
        lines.append(f"| {name} | {m['before']:.3f} | {m['after']:.3f} | {m['delta']:+.3f} | {shown} |")
    return "\n".join(lines) + "\n\nIntervals: paired bootstrap over held-out items (vlmrl compare).\n"


def _dataset(run_dir: Path) -> str:
    path = run_dir / layout.DATA_SUMMARY
    if not path.is_file():
        return "## Data\n\nNo data/summary.json in the run.\n"
    summary = json.loads(path.read_text())
    counts = summary.get("counts", {})
    return (
        "## Data\n\n"
        f"- source: {summary.get('source')}\n"
        f"- train items: {counts.get('train')}, held-out items: {counts.get('holdout')}, "
        f"dropped: {counts.get('dropped')} ({summary.get('dropped_by_reason') or 'none'})\n"
        f"- contamination check between train and held-out images: {summary.get('contamination_check')}\n"
        + (f"- comparable to published MathVista figures: {summary['comparable_to_published']}\n"
           if summary.get("comparable_to_published") is not None else "")  # claimed for MathVista sources only
    )


def _base_model(config: Config, base_name: str) -> str:
    """The base model as a reader can find it: a hub link, the user's path, or the copy in this folder."""
    if base_name == LOCAL_BASE:
        return f"`{config.model.name}` (built by vlmrl, on no hub: copied into this folder as `{LOCAL_BASE}/`)"
    return _linked(base_name, "model")


def _linked(name: str, kind: str) -> str:
    """A hub id as a link to its hub page; any other name (a local path, this folder) as plain text.

    >>> _linked("Qwen/Qwen3-VL-8B-Instruct", "model"), _linked("AI4Math/MathVista", "dataset"), _linked("./m", "model")
    ('[Qwen/Qwen3-VL-8B-Instruct](https://huggingface.co/Qwen/Qwen3-VL-8B-Instruct)', \
'[AI4Math/MathVista](https://huggingface.co/datasets/AI4Math/MathVista)', '`./m`')
    """
    if HUB_ID.match(name) and not Path(name).exists():
        return f"[{name}](https://huggingface.co/{'datasets/' if kind == 'dataset' else ''}{name})"
    return f"`{name}`"


def _data_source(source: str) -> str:
    """The data named for a reader: a hub dataset linked, a local file or folder by its name (not this machine's
    path), the built-in generator by what it is."""
    if source == "synthetic":
        return "vlmrl's built-in synthetic visual-math figures"
    if HUB_ID.match(source) and not Path(source).exists():
        return f"the dataset {_linked(source, 'dataset')}"
    return f"a local dataset, `{Path(source).name}`"


def _usage(kind: str, base_name: str) -> str:
    if kind == "adapter":
        base = f'"{base_name}"' if base_name != LOCAL_BASE else f'f"{{folder}}/{LOCAL_BASE}"'
        return (
            "## Use\n\n```python\nfrom peft import PeftModel\n"
            "from transformers import AutoModelForImageTextToText, AutoProcessor\n\n"
            'folder = "path/to/this/folder"  # or the hub repo id\n'
            f"base = AutoModelForImageTextToText.from_pretrained({base})\n"
            "model = PeftModel.from_pretrained(base, folder)\n"
            "processor = AutoProcessor.from_pretrained(folder)\n```\n"
        )
    snippet = (
        "## Use\n\n```python\nfrom transformers import AutoModelForImageTextToText, AutoProcessor\n\n"
        'folder = "path/to/this/folder"  # or the hub repo id\n'
        "model = AutoModelForImageTextToText.from_pretrained(folder)\n"
        "processor = AutoProcessor.from_pretrained(folder)\n```\n"
    )
    if kind == "merged-16bit":
        snippet += '\nWith vLLM:\n\n```python\nfrom vllm import LLM\n\nllm = LLM(model="path/to/this/folder")\n```\n'
    return snippet


def push_folder(folder: Path, repo_id: str, *, private: bool, api: Any = None) -> str:
    """Create `repo_id` (if needed) and upload `folder`; returns the commit URL. `api` is for tests."""
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                             commit_message="Upload from vlmrl export")
    return str(getattr(info, "commit_url", info))
