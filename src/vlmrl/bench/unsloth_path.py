"""The `unsloth` bench path: Unsloth's `FastVisionModel` under the same GRPOTrainer, GRPOConfig and step clock.

Unsloth patches transformers, TRL and PEFT when it is imported, and must be imported before them. `vlmrl bench`
has imported all three long before it reaches a path, so this path runs in a fresh interpreter whose first import
is `unsloth` (`CHILD_CODE`). The parent saves the shaped random weights once as a folder (`save_weights_once`);
the child loads that folder by name through `FastVisionModel.from_pretrained`, puts LoRA on the language layers
with `FastVisionModel.get_peft_model` (vision frozen, the same r/alpha and projections as the other paths),
trains it with `bench.run.train_and_measure` (`unsloth_child`) and writes the path's record as JSON, which the parent adds to the
table beside its own paths.

Unsloth pins older TRL/datasets/transformers than vlmrl's own paths use, so its packages may live in a folder
of their own: `VLMRL_UNSLOTH_SITE` names it, and then the child's import path is that folder and vlmrl's source
alone (benchmarks/NOTES.md, "Unsloth"); every record says which versions ran it.
Left out: Unsloth's vLLM rollouts (`fast_inference`), several GPUs, and the `--generation-batches` table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

UNSLOTH_PATHS = ("unsloth",)
SITE_ENV = "VLMRL_UNSLOTH_SITE"
# Which of the modules Unsloth must precede were already imported when `unsloth` was: recorded, must be none.
CHILD_CODE = ("import sys; _before = sorted(m for m in ('transformers', 'trl', 'peft') if m in sys.modules); "
              "import unsloth; from vlmrl.bench.unsloth_child import child_main; child_main(_before)")


def unsloth_site() -> Path | None:
    """The folder holding Unsloth and its pins, apart from vlmrl's packages (None: the running environment)."""
    site = os.environ.get(SITE_ENV)
    return Path(site) if site else None


def unsloth_unavailable_reason() -> str | None:
    """Why the unsloth path cannot run here (one line), or None."""
    site = unsloth_site()
    installed = ((site / "unsloth" / "__init__.py").is_file() if site
                 else importlib.util.find_spec("unsloth") is not None)
    cuda = torch.cuda.is_available()
    if installed and cuda:
        return None
    where = f"{SITE_ENV}={site}" if site else "this environment"
    return (f"bench path unsloth needs the unsloth package and a CUDA GPU (unsloth in {where}: "
            f"{'yes' if installed else 'no'}, CUDA: {'yes' if cuda else 'no'}); "
            "see benchmarks/NOTES.md, Unsloth, for its wheels and benchmarks/gpu_unsloth.sh.")


def child_env() -> dict[str, str]:
    """The child's environment: with a separate site, only that site and vlmrl's source are importable (vlmrl's
    own newer TRL/datasets/transformers would otherwise shadow Unsloth's pins or the other way round)."""
    env = dict(os.environ)
    site = unsloth_site()
    if site:
        vlmrl_root = Path(__file__).resolve().parents[2]  # the folder holding the `vlmrl` package
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(vlmrl_root)])
    return env


def run_unsloth(settings: Any, model_dir: Path, work: Path) -> dict:
    """Run the unsloth path in its own interpreter and return its record; a failed process is recorded as the
    path's error (its last output lines), never raised, so the other paths' numbers stay. Its output is passed
    through as it comes: a bench cut short by a time limit still shows how far the child got."""
    from collections import deque
    from dataclasses import asdict

    from vlmrl.bench.shaped import free_memory

    free_memory()  # hand this process's cached blocks back: the child measures its own peak on the same GPU
    work.mkdir(parents=True, exist_ok=True)
    settings_file, out_file = work / "unsloth-settings.json", work / "unsloth-result.json"
    settings_file.write_text(json.dumps(asdict(settings)))
    out_file.unlink(missing_ok=True)
    command = [sys.executable, "-c", CHILD_CODE, str(settings_file), str(model_dir), str(work / "unsloth"),
               str(out_file)]
    tail: deque[str] = deque(maxlen=6)
    with subprocess.Popen(command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as child:
        for line in child.stdout or ():
            sys.stderr.write(line)
            if line.strip():
                tail.append(line.strip())
        code = child.wait()
    if code != 0 or not out_file.is_file():
        return failed_record(f"the unsloth process exited {code}: {' | '.join(tail)}"[:2000])
    return json.loads(out_file.read_text())


def failed_record(error: str) -> dict:
    """A path record with no step: `summarize` reports its error in the table."""
    return {"path": "unsloth", "error": error, "fast_generation": None, "total_seconds": 0.0, "steps": [],
            "peak_memory_gib": 0.0, "peak_reserved_gib": 0.0, "log": []}


def load_unsloth_model(model_dir: Path, settings: Any) -> tuple[Any, Any]:
    """The shaped folder through FastVisionModel, LoRA on the language attention and MLP projections only."""
    from unsloth import FastVisionModel

    model, processor = FastVisionModel.from_pretrained(
        str(model_dir),
        load_in_4bit=settings.load_in_4bit,
        dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32,
        # prompt (~300 tokens at 512 px) + the forced completion, with room to spare
        max_seq_length=settings.completion + 1024,
        use_gradient_checkpointing="unsloth",
    )
    model = FastVisionModel.get_peft_model(
        model,
        finetune_vision_layers=False,
        finetune_language_layers=True,
        finetune_attention_modules=True,  # q/k/v/o
        finetune_mlp_modules=True,  # gate/up/down
        r=settings.lora_r,
        lora_alpha=settings.lora_r,
        lora_dropout=0.0,
        bias="none",
        random_state=0,
    )
    return model, processor
