"""The visual control as a stage: how much of a before/after gain needs the image?

Accuracy can rise without any better reading of the figure (a better answer prior, answers in a gradable
form). So the held-out set is also evaluated with each item's image(s) swapped for another held-out item's
(`vlmrl.evaluate.swap`), before training (base policy) and after (the adapter), by the same records code as
stage 5/7 (`evaluate` with `swap_seed`): `baseline_swapped_records.jsonl`, `after_swapped_records.jsonl`, each
record naming the item whose image it saw (`image_from`). The gain is computed by `vlmrl.compare.visual_gain`
and shown by `vlmrl.report.visual`.

Left out: several swaps per item (one derangement is already paired per item; more would only tighten the
swapped side), and any judgement of *why* a gap moves.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vlmrl.evaluate.stage import evaluate
from vlmrl.run import layout
from vlmrl.run.layout import STAGES


def evaluate_swapped(config, run_dir: Path, progress_factory: Callable[[str], object] | None = None) -> None:
    """Evaluate both stages on swapped images (a stage whose summary is complete is skipped)."""
    for stage in STAGES:
        if not layout.eval_done(config, run_dir, stage + layout.SWAPPED):
            progress = progress_factory(stage + layout.SWAPPED) if progress_factory else None
            evaluate(config, run_dir, stage, swap_seed=config.run.seed, progress=progress)


