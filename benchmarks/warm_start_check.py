"""How well does the demo-gpu warm start read each family? Builds `DEMO_GPU_RECIPE` with overrides into a
scratch folder (never the cache), never stopping early, and writes its per-family reading checks.

Run from the repository root on the GPU machine (about 3 minutes on an H200):
    PYTHONPATH=src python3 benchmarks/warm_start_check.py OUTDIR sft_items=25600 check_items=256
    ... OUTDIR families=count_squares,scatter_count,bar_max image_size=384     (lists: comma-separated)
`--keep FOLDER` keeps the built policy there, ready for the whole demo on it (the run's data must match the
recipe's families and image size):
    bash benchmarks/gpu_visual_learning.sh OUT2 model.name=FOLDER 'data.families=[count_squares,scatter_count,bar_max]' data.image_size=384
Writes OUTDIR/warm_start_check.json: the recipe as run, the greedy accuracy on `check_items` unseen figures every
`check_every` steps, overall and per family, and the build's seconds. Left out: any RL (docs/learning.md).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    from vlmrl.models.demo import DEMO_GPU_RECIPE, build_demo_policy

    args = sys.argv[1:]
    keep = Path(args.pop(args.index("--keep") + 1)) if "--keep" in args else None
    args = [a for a in args if a != "--keep"]
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    recipe = {**DEMO_GPU_RECIPE, "stop_accuracy": 0.99}  # 0.99: run every step, to see the whole curve
    for item in args[1:]:
        key, value = item.split("=", 1)
        if key not in recipe:
            raise SystemExit(f"{key}: not a recipe key ({', '.join(sorted(recipe))})")
        default = recipe[key]
        recipe[key] = (value == "true" if isinstance(default, bool) else value.split(",") if isinstance(default, list)
                       else type(default)(value))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        folder = keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        info = build_demo_policy(folder, recipe, say=lambda m: print(m, flush=True))
        (folder / "demo_policy.json").write_text(json.dumps(info, indent=2))
    result = {"recipe": recipe, "seconds": round(time.perf_counter() - started, 1),
              "sft_steps_run": info["sft_steps_run"], "reading_checks": info["reading_checks"],
              "command": "PYTHONPATH=src python3 benchmarks/warm_start_check.py OUTDIR " + " ".join(args[1:])}
    (out / "warm_start_check.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
