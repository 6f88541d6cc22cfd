"""Stages 5 and 7, evaluation: the held-out set, one record per item, written as each batch finishes.

A record keeps the raw completion *and* everything derived from it (extracted answer, each reward, our
verdict and MathVista's), plus the ids and hashes that join a baseline record to its after-training twin.
An interrupted evaluation resumes at the first batch with a missing id; records from a different evaluation
setting are refused rather than mixed. The adapter is one of those settings by its content (its files'
digest, as stages.json records it), not only its path: a training run again into the same `train/final`
makes the records of the old adapter another setting's.

Checks that need no model (holdout present, non-empty and from this config; adapter folder present and
made for this base model) run first, so a mistake costs seconds, not a model load.

Launched as several processes (`vlmrl eval --gpus N`), the batches still missing are dealt round-robin to the
ranks; each writes its own `<stage>_records.rank<k>.jsonl`, and rank 0 merges them into the records file in
holdout order. Batches keep their slices and seeds, so the records do not depend on the number of processes;
shards a killed run left behind are merged by the next run, whatever its process count.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vlmrl.common import distributed, stats
from vlmrl.common.io import append_jsonl, read_json, read_jsonl, write_json_atomic, write_jsonl_atomic
from vlmrl.config.schema import Config
from vlmrl.data.items import open_record_images, record_hashes
from vlmrl.engine.rollout import fast
from vlmrl.engine.rollout.compile_cache import use_compile_cache
from vlmrl.engine.rollout.generation import generate_batch
from vlmrl.grading.grader import grade
from vlmrl.grading.mathvista import mathvista_correct, normalize_mathvista
from vlmrl.grading.rewards import score_completion
from vlmrl.grading.user_rewards import (
    Reward,
    call_rewards,
    item_columns,
    load_rewards,
    prompt_messages,
    reward_check,
    weighted_total,
)
from vlmrl.models.loading import adapter_base_problem, load_with_adapter
from vlmrl.run import layout
from vlmrl.run.claim import relative_to_run
from vlmrl.run.layout import STAGES, read_holdout, rewards_fingerprint

log = logging.getLogger(__name__)
# The generation settings' key for the adapter's content (with an adapter only: baseline records keep their keys).
ADAPTER_DIGEST = "adapter_digest"


class EvalError(RuntimeError):
    """The evaluation cannot start; the message names the path and the fix."""


@dataclass(frozen=True)
class EvalResult:
    records_path: Path
    summary_path: Path
    summary: dict


def evaluate(
    config: Config,
    run_dir: Path,
    stage: str,
    *,
    adapter: Path | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    swap_seed: int | None = None,
) -> EvalResult:
    """Evaluate the held-out set of `run_dir` at `stage` (baseline: no adapter; after: the trained one).
    With `swap_seed`, each item is shown another item's image(s) (`vlmrl.evaluate.visual_control`), into
    `<stage>_swapped_records.jsonl` / `<stage>_swapped_summary.json`."""
    from vlmrl.common.provenance import provenance, utc_now

    started_at = utc_now()
    # step 1: every check that needs no model
    if stage not in STAGES:
        raise EvalError(f"--stage {stage!r}: choose baseline or after.")
    try:
        items = read_holdout(config, run_dir)
    except layout.RunFolderError as exc:
        raise EvalError(str(exc)) from None
    name = stage
    if swap_seed is not None:
        from vlmrl.evaluate.swap import derangement, swap_images

        items, name = swap_images(items, derangement(items, swap_seed)), stage + layout.SWAPPED
    rewards, checked = reward_check(config, run_dir)  # a broken reward fails here, before any model loads
    rewards_key = rewards_fingerprint(config)
    if stage == "after":
        adapter = adapter or run_dir / layout.FINAL
    if adapter is not None and (problem := adapter_base_problem(adapter, config.model.name, run_dir, config.run.seed)):
        raise EvalError(problem)
    records_path = run_dir / layout.records_file(name)
    settings = generation_settings(config, adapter, run_dir)
    if swap_seed is not None:
        settings["image_swap_seed"] = swap_seed
    shards = _shard_files(records_path)  # left by a killed multi-process run, if any
    done = _existing_records([records_path, *shards], settings)
    if distributed.is_main_process():
        for path in [records_path, *shards]:
            if path.exists() and rescore_records(path, run_dir, items, rewards, rewards_key):
                log.info("%s: rescored records made under other rewards", path)
    size = config.eval.batch_size
    # Batches are fixed slices of the holdout, and one with any record missing is generated whole (only its
    # missing records are kept): a kill that tore a batch's lines then changes no other batch's inputs.
    starts = range(0, len(items), size)
    todo = [start for start in starts if any(item["id"] not in done for item in items[start : start + size])]
    world = distributed.world_size()
    # a collective, so also the barrier: every rank has read the same files before any rank writes
    if differing := distributed.ranks_differing(distributed.file_digest(run_dir / layout.HOLDOUT)):
        raise EvalError(f"{run_dir / layout.HOLDOUT} differs between rank 0 and rank(s) "
                        f"{', '.join(map(str, differing))}: every host must read the same run folder, on a "
                        "filesystem all of them see (docs/multi_gpu.md, Several hosts).")
    mine = distributed.my_share(todo)
    out_path = _shard_path(records_path, distributed.rank()) if world > 1 else records_path
    live = progress if world == 1 else None  # with several ranks, one rank's count is not the run's
    if progress and not live and todo:  # several ranks: the bar starts here and fills at the merge
        progress(len(done), len(items), 0)

    # step 2: generate this rank's missing batches, appending records as each batch finishes
    if mine:
        loaded = load_with_adapter(config.model, run_dir, adapter, config.run.seed)
        compiled = fast.wanted(config.eval.compile)
        if compiled:
            use_compile_cache()  # before the first compile: kept with vlmrl's cache across runs
        started, tokens, finished = time.perf_counter(), 0, len(done)
        if live:
            live(finished, len(items), 0)
        for start in mine:
            batch = items[start : start + size]
            # Seeded by its place in the holdout: a sampled evaluation repeats exactly, resumed or not.
            torch.manual_seed(config.run.seed * 1_000_003 + start)
            t0 = time.perf_counter()
            images = [open_record_images(run_dir, item) for item in batch]
            generations = generate_batch(
                loaded.model,
                loaded.processor,
                [item["prompt"] for item in batch],
                images,
                max_new_tokens=config.eval.max_new_tokens,
                do_sample=config.eval.do_sample,
                temperature=config.eval.temperature,
                num_return_sequences=config.eval.num_samples if config.eval.do_sample else 1,
                compiled=compiled,
                systems=[item.get("system") for item in batch],
            )
            seconds = time.perf_counter() - t0
            rows = [make_record(item, gens, settings, seconds / len(batch), stage, rewards=rewards, image=image,
                                rewards_key=rewards_key, contract=config.contract)
                    for item, gens, image in zip(batch, generations, images) if item["id"] not in done]
            append_jsonl(out_path, rows)
            tokens += sum(r["generated_tokens"] for r in rows)
            finished += len(rows)
            if live:
                live(finished, len(items), tokens)
        log.info("%s eval: %d items in %.1fs (rank %d of %d)", stage, finished - len(done),
                 time.perf_counter() - started, distributed.rank(), world)
    distributed.barrier()  # every shard is complete

    # step 3: rank 0 merges the shards, then writes the summary, recomputed from the records on disk
    summary_path = run_dir / layout.summary_file(name)
    if distributed.is_main_process():
        shards = _shard_files(records_path)
        if shards:
            merge_shards(records_path, shards, [item["id"] for item in items])
        records = read_jsonl(records_path)
        if progress and not live and todo:
            progress(len(records), len(items), sum(r["generated_tokens"] for r in records if r["id"] not in done))
        summary = summarize(records, stage=name, seed=config.run.seed)
        summary["reward_check"] = checked  # the means of the check before it, per reward and fake completion
        summary["provenance"] = provenance(started_at=started_at, finished_at=utc_now())
        write_json_atomic(summary_path, summary)
    distributed.barrier()  # the summary exists before any rank reads it
    return EvalResult(records_path, summary_path, read_json(summary_path))


def merge_shards(records_path: Path, shards: list[Path], order: list[str]) -> None:
    """Fold per-rank shard files into `records_path` (one record per id, the first written wins, holdout
    order), atomically, then delete the shards. A kill between the two leaves shards whose ids are all
    in the records file already: the next merge drops them as duplicates."""
    position = {item_id: i for i, item_id in enumerate(order)}
    merged: dict[str, dict] = {}
    for path in [records_path, *shards]:
        for record in read_jsonl(path):
            merged.setdefault(record["id"], record)
    rows = sorted(merged.values(), key=lambda r: position.get(r["id"], len(order)))
    write_jsonl_atomic(records_path, rows)
    for path in shards:
        path.unlink()


def generation_settings(config: Config, adapter: Path | None, run_dir: Path | None = None) -> dict:
    """What a record's generation depended on; an adapter inside `run_dir` is stored relative to it, so a moved
    or copied run keeps its records (they are matched against these settings on resume), and with an adapter,
    its content's digest (`layout.folder_digest`), so records of an earlier adapter at that path are not."""
    e = config.eval
    settings = {
        "max_new_tokens": e.max_new_tokens,
        "do_sample": e.do_sample,
        "temperature": e.temperature if e.do_sample else None,
        "num_samples": e.num_samples if e.do_sample else 1,
        "model": config.model.name,
        "adapter": relative_to_run(adapter, run_dir) if adapter else None,
    }
    if adapter:
        settings[ADAPTER_DIGEST] = layout.folder_digest(Path(adapter))
    return settings


def only_the_adapter_differs(made: object, settings: dict) -> bool:
    """Whether records made with the settings `made` differ from `settings` by the adapter's content alone
    (records from before the digest was kept count as another adapter's)."""
    return (isinstance(made, dict) and made != settings
            and {**made, ADAPTER_DIGEST: None} == {**settings, ADAPTER_DIGEST: None})



def make_record(item: dict, generations: list, settings: dict, seconds: float, stage: str, *,
                rewards: list[Reward] | None = None, image: object = None, rewards_key: str | None = None,
                contract: str = "seed") -> dict:
    """One held-out item's record; `rewards` are the configured ones (default: format 0.3 + correctness 1.0),
    each called on the item's completions with the item's columns as TRL would; `rewards_key` is their
    fingerprint (records scored under another one are rescored, see `rescore_records`). The answer is read
    and the format checked under `contract`."""
    rewards = rewards if rewards is not None else load_rewards(Config(contract=contract))
    samples = [_score(item, g, contract) for g in generations]
    for sample, scored in zip(samples, score_rewards(item, [g.text for g in generations], rewards, image)):
        sample.update(scored)
    first = samples[0]
    record = {
        "id": item["id"],
        "stage": stage,
        "question": item["question"],
        "gold": item["answer"],
        "answer_type": item.get("answer_type"),
        "precision": item.get("precision"),
        "contract": contract,
        **first,
        "image_sha256": record_hashes(item),  # one per image, in order
        "prompt_sha256": hashlib.sha256(item["prompt"].encode()).hexdigest()[:16],
        "category": item.get("category"),
        **({"image_from": item["image_from"]} if "image_from" in item else {}),  # the visual control's swap
        "metadata": item.get("metadata") or {},
        "generation": settings,
        "rewards_fingerprint": rewards_key,
        "seconds": round(seconds, 4),
        "provenance": _record_provenance(),
    }
    if len(samples) > 1:
        votes = Counter(_vote_key(item, s["pred"]) for s in samples if s["pred"] is not None)
        majority = votes.most_common(1)[0][0] if votes else None
        record["samples"] = samples
        record["pass_at_k"] = any(s["correct"] for s in samples)
        record["majority_pred"] = majority
        record["majority_correct"] = majority is not None and score_completion(
            f"<SOLUTION>{majority}</SOLUTION>", item["answer"], **_grading_fields(item)
        )["correct"]
    return record


def _grading_fields(item: dict) -> dict:
    """The item's answer type, choices and precision, as ``score_completion`` takes them."""
    return {k: item.get(k) for k in ("answer_type", "choices", "precision")}


def _vote_key(item: dict, pred: str) -> str:
    """What a sample's answer counts as in the majority vote: a choice's letter votes for its text."""
    choices = item.get("choices") or []
    if item.get("answer_type") == "choice":
        named = {c for c in choices if grade(pred, c, "choice", choices=choices)}
        if len(named) == 1:
            return named.pop()
    return pred


def _record_provenance() -> dict:
    from vlmrl.common.provenance import provenance

    return provenance()


def score_rewards(item: dict, texts: list[str], rewards: list[Reward], image: object = None) -> list[dict]:
    """Per completion: every configured reward under its name, and their weighted total."""
    values = call_rewards(rewards, [prompt_messages(item["prompt"], image)] * len(texts), texts,
                          [item_columns(item, image)] * len(texts))
    out = []
    for k in range(len(texts)):
        each = {name: scores[k] for name, scores in values.items()}
        out.append({"rewards": each, "total_reward": weighted_total(each, rewards)})
    return out


def rescore_records(path: Path, run_dir: Path, items: list[dict], rewards: list[Reward], key: str) -> int:
    """Re-score, from their completions, the records of `path` made under other rewards (a changed reward
    file or weight): the rewards are a function of the completion, so no generation is repeated. Returns
    how many were rescored."""
    records = read_jsonl(path)
    stale = [r for r in records if r.get("rewards_fingerprint") != key]
    by_id = {item["id"]: item for item in items}
    for record in stale:
        item = by_id.get(record["id"])
        if item is None:
            continue
        samples = record.get("samples") or [record]
        scored = score_rewards(item, [s["completion"] for s in samples], rewards, open_record_images(run_dir, item))
        for sample, new in zip(samples, scored):
            sample.update(new)
        record.update(scored[0], rewards_fingerprint=key)
    if stale:
        write_jsonl_atomic(path, records)
    return len(stale)


def _score(item: dict, generation, contract: str = "seed") -> dict:
    scored = score_completion(generation.text, item["answer"], **_grading_fields(item), contract=contract)
    question_type = "multi_choice" if item.get("choices") else "free_form"
    normalized = normalize_mathvista(
        scored["pred"],
        question_type=question_type,
        answer_type=item.get("answer_type") or "integer",
        precision=item.get("precision"),
        choices=item.get("choices"),
    )
    return {
        "completion": generation.text,
        "pred": scored["pred"],
        "format_ok": scored["format_ok"],
        "format_reward": scored["format"],
        "correctness_reward": scored["correctness"],
        "correct": scored["correct"],
        "exact_match": scored["exact_match"],
        "degenerate": scored["degenerate"],
        "mathvista_normalized": normalized,
        "mathvista_correct": mathvista_correct(normalized, item["answer"]),
        "generated_tokens": generation.tokens,
        "truncated": generation.truncated,
    }


def summarize(records: list[dict], *, stage: str, seed: int = 0) -> dict:
    """Headline numbers with 95% bootstrap intervals, computed from records only."""

    def metric(values: list[float]) -> dict:
        lo, hi = stats.bootstrap_ci(values, seed=seed)
        return {"mean": stats.mean(values), "ci95": [lo, hi]}

    seconds = sum(r.get("seconds", 0.0) for r in records)
    tokens = sum(r["generated_tokens"] for r in records)
    summary = {
        "stage": stage,
        "n": len(records),
        "accuracy": metric([float(r["correct"]) for r in records]),
        "mathvista_accuracy": metric([float(r["mathvista_correct"]) for r in records]),
        "exact_match": metric([float(r["exact_match"]) for r in records]),
        "format_compliance": metric([float(r["format_ok"]) for r in records]),
        "format_reward": metric([r["format_reward"] for r in records]),
        "correctness_reward": metric([r["correctness_reward"] for r in records]),
        "total_reward": metric([r["total_reward"] for r in records]),
        "truncation_rate": stats.mean([float(r["truncated"]) for r in records]),
        "gibberish_rate": stats.mean([float(r["degenerate"]) for r in records]),
        "mean_generated_tokens": stats.mean([r["generated_tokens"] for r in records]),
        "tokens_per_second": tokens / seconds if seconds else None,
        "items_per_second": len(records) / seconds if seconds else None,
    }
    names = dict.fromkeys(name for r in records for name in r.get("rewards") or {})
    # every configured reward alone; a None (the reward skipped the item) is left out of its mean
    summary["rewards"] = {name: metric([r["rewards"][name] for r in records
                                        if (r.get("rewards") or {}).get(name) is not None]) for name in names}
    keys = {r.get("rewards_fingerprint") for r in records}
    summary["rewards_fingerprint"] = keys.pop() if len(keys) == 1 else None  # which rewards scored them
    contracts = {r.get("contract", "seed") for r in records}  # records made before contracts are seed
    summary["contract"] = contracts.pop() if len(contracts) == 1 else None
    if records and "pass_at_k" in records[0]:
        summary["pass_at_k"] = metric([float(r["pass_at_k"]) for r in records])
        summary["majority_accuracy"] = metric([float(r["majority_correct"]) for r in records])
    return summary


def _existing_records(paths: list[Path], settings: dict) -> set[str]:
    ids: set[str] = set()
    for path in paths:
        for record in read_jsonl(path):
            made = record.get("generation")
            if only_the_adapter_differs(made, settings):
                raise EvalError(
                    f"{path}: holds records of another adapter: the files of {settings['adapter']} changed since "
                    "they were made (say, a training run again); delete the file to evaluate this adapter.")
            if made != settings:
                raise EvalError(
                    f"{path}: holds records made with other generation settings ({record.get('generation')}); "
                    "delete the file or restore the settings to resume."
                )
            ids.add(record["id"])
    return ids


def _shard_path(records_path: Path, rank: int) -> Path:
    return records_path.with_name(f"{records_path.stem}.rank{rank}.jsonl")


def _shard_files(records_path: Path) -> list[Path]:
    return sorted(records_path.parent.glob(f"{records_path.stem}.rank*.jsonl"))



