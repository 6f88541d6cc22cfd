"""The `unsloth` bench path's child process, started by `unsloth_path.run_unsloth` with `unsloth` imported
first: load the saved shaped model through Unsloth, train it under the bench's clock, write the record."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from vlmrl.bench.run import prepare_device, train_and_measure
from vlmrl.bench.shaped import BenchSettings, bench_dataset
from vlmrl.bench.summary import versions
from vlmrl.bench.unsloth_path import load_unsloth_model
from vlmrl.common.io import strict_json
from vlmrl.common.provenance import package_version


def child_main(imported_before: list[str]) -> None:
    """The child process (after `import unsloth`): argv = settings JSON, model folder, work folder, out JSON."""
    settings_file, model_dir, work, out_file = (Path(a) for a in sys.argv[1:5])
    settings = BenchSettings(**json.loads(settings_file.read_text()))
    work.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():  # this process's memory cap; the parent refuses the path without CUDA
        prepare_device(settings, work)
    dataset = bench_dataset(settings)
    model, processor = load_unsloth_model(model_dir, settings)
    result = train_and_measure("unsloth", settings, model, processor, dataset, work, peft_config=None)
    result["imported_before_unsloth"] = imported_before
    result["versions"] = {**versions(), **{name: package_version(name) for name in ("unsloth", "unsloth_zoo", "datasets")}}
    out_file.write_text(strict_json(result, indent=2))
