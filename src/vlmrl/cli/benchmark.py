"""`vlmrl bench`: the side-by-side GPU benchmark's options, each checked in one line before anything loads, then
vlmrl.bench run (the command is registered on the app in vlmrl.cli.app)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from vlmrl.cli import show
from vlmrl.cli.errors import fail
from vlmrl.cli.launch import one_gpu_per_process
from vlmrl.cli.show import console

if TYPE_CHECKING:
    from vlmrl.bench import BenchSettings


def bench(
    shapes: Annotated[str, typer.Option(help="Shapes file in vlmrl/preflight/shapes/: qwen3_vl_8b, qwen3_vl_32b (no "
                                        "weights are downloaded).")] = "qwen3_vl_8b",
    steps: Annotated[int, typer.Option(help="Optimizer steps per path (the first is reported apart).")] = 2,
    steps_plain: Annotated[int | None, typer.Option(
        help="Steps for plain TRL alone (it compiles nothing, so one step is already steady; default: --steps).")] = None,
    warmup_steps: Annotated[int, typer.Option(
        help="Steps per path set apart from the steady figures (the first compiles; the second still does one-off "
             "work). A path with no more steps keeps all but its first.", min=1)] = 1,
    completion: Annotated[int, typer.Option(help="Completion tokens, forced.")] = 1024,
    paths: Annotated[str, typer.Option(
        help="Comma-separated, of: plain (TRL's GRPOTrainer as is), vlmrl (vlmrl train's engine), unsloth (Unsloth's "
             "FastVisionModel, in a process of its own); engine variants through benchmarks/engine_variants.py.")
    ] = "plain,vlmrl",
    load_in_4bit: Annotated[bool, typer.Option("--load-in-4bit", help="bitsandbytes 4-bit base weights.")] = False,
    memory_cap_gib: Annotated[float | None, typer.Option(help="Cap this process's GPU memory.")] = None,
    dtype: Annotated[str, typer.Option(help="bfloat16 | float16: the base's (compute) dtype and the mixed "
                                             "precision (float16: a card without bfloat16, e.g. a T4).")] = "bfloat16",
    micro_batch: Annotated[int | None, typer.Option(
        help="Completions per micro-step (default: the prompts per step); the accumulation keeps the step's "
             "completions.")] = None,
    steps_per_generation: Annotated[int | None, typer.Option(
        help="Micro-steps per rollout (default: one rollout per optimizer step).")] = None,
    out: Annotated[Path, typer.Option(help="Where bench.json and bench.md go.")] = Path("bench-out"),
    save_model: Annotated[Path | None, typer.Option(
        help="Only write a loadable random-weight model of these shapes to this folder, then stop.")] = None,
    compile_cache: Annotated[Path | None, typer.Option(
        help="torch.compile's cache folder (default: <vlmrl cache>/compile). Run twice with the same empty folder "
             "to measure the first step cold, then warm.")] = None,
    generation_batches: Annotated[str | None, typer.Option(
        help="Comma-separated generation batches (completions per rollout, multiples of 4), e.g. 32,64,128,256: "
             "measure samples/s and peak memory at each for the paths named, instead of the side-by-side table.")] = None,
    comm_profile: Annotated[bool, typer.Option(
        "--comm-profile", help="Run one more step, profiled, for its NCCL kernel time (the communication share on "
        "several GPUs); that step is left out of the step times.")] = False,
    ragged_median: Annotated[int | None, typer.Option(
        help="Ragged completions instead of forced ones: each completion's length drawn from a log-normal with this "
             "median and a tenth at the --completion cap (e.g. 600 with --completion 4096); the floors count "
             "only the rows still generating.")] = None,
    varied_reward: Annotated[bool, typer.Option(
        "--varied-reward", help="Add a third reward that differs between completions (a hash of the text): "
        "the random-weight model then gets non-zero advantages and real gradients.")] = False,
) -> None:
    """Side-by-side GPU benchmark: plain TRL GRPOTrainer vs vlmrl's path, same model shapes, one process.

    Under `accelerate launch --num_processes N` every rank runs the same per-GPU batch on its own GPU; rank 0
    writes the results (samples per second and peak memory of every GPU included)."""
    import tempfile

    from vlmrl.bench import BenchSettings, path_names, run_bench, save_shaped_model
    from vlmrl.bench.throughput import parse_batches
    from vlmrl.common.distributed import is_main_process, world_size
    from vlmrl.preflight.memory import shape_names

    if shapes not in shape_names():
        fail(f"--shapes {shapes}: choose one of {', '.join(shape_names())} (files in vlmrl/preflight/shapes/).")
    unknown = [p for p in paths.split(",") if p not in path_names()]
    if unknown:
        fail(f"unknown bench path(s) {', '.join(unknown)}; choose from {', '.join(path_names())} (engine variants: "
             "python3 benchmarks/engine_variants.py bench --paths ...)")
    if dtype not in ("bfloat16", "float16"):
        fail(f"--dtype {dtype}: choose bfloat16 or float16.")
    completions = BenchSettings.prompts * BenchSettings.generations
    micro = micro_batch or BenchSettings.prompts
    if (micro < 1 or completions % micro
            or micro * (steps_per_generation or completions // micro) % BenchSettings.generations):
        fail(f"--micro-batch {micro_batch} --steps-per-generation {steps_per_generation}: the micro-batch must "
             f"divide the {completions} completions of a step, and a rollout (micro-batch x steps per generation) "
             f"hold whole groups of {BenchSettings.generations}.")
    if ragged_median is not None and not 1 <= ragged_median < completion:
        fail(f"--ragged-median {ragged_median}: give a median of at least 1 and below --completion ({completion}).")
    if ragged_median is not None and generation_batches:
        fail("--ragged-median measures the side-by-side table; --generation-batches forces full-length completions.")
    if "unsloth" in paths.split(","):
        _unsloth_bench_checks(generation_batches is not None)
    try:
        batches = parse_batches(generation_batches, BenchSettings.generations) if generation_batches else None
    except ValueError as exc:
        fail(f"--generation-batches: {exc}")
    one_gpu_per_process(world_size(), saving=save_model is not None)
    if save_model is not None:
        console.print(f"saved {save_shaped_model(save_model, shapes)}")
        return
    settings = BenchSettings(shapes=shapes, steps=steps, steps_plain=steps_plain, warmup_steps=warmup_steps,
                             completion=completion, paths=paths.split(","),
                             load_in_4bit=load_in_4bit, memory_cap_gib=memory_cap_gib, dtype=dtype,
                             micro_batch=micro_batch, steps_per_generation=steps_per_generation,
                             compile_cache=str(compile_cache) if compile_cache else None, comm_profile=comm_profile,
                             varied_reward=varied_reward, ragged_median=ragged_median)
    if batches is not None:
        _bench_throughput(settings, batches, out)
        return
    with tempfile.TemporaryDirectory(prefix="vlmrl-bench-") as work:
        summary = run_bench(settings, out, Path(work))
    if is_main_process():
        show.show_bench(out, summary)


def _unsloth_bench_checks(batches: bool) -> None:
    """The unsloth path: installed, on CUDA, one process, the side-by-side table only (one-line refusals)."""
    from vlmrl.bench.unsloth_path import unsloth_unavailable_reason
    from vlmrl.common.distributed import world_size

    if reason := unsloth_unavailable_reason():
        fail(reason)
    if batches:
        fail("bench path unsloth is measured in the side-by-side table only, not with --generation-batches.")
    if world_size() > 1:
        fail("bench path unsloth runs on one GPU in one process; run it without accelerate launch / torchrun.")


def _bench_throughput(settings: BenchSettings, batches: list[int], out: Path) -> None:
    import tempfile

    from vlmrl.bench.throughput import run_throughput
    from vlmrl.common.distributed import is_main_process

    with tempfile.TemporaryDirectory(prefix="vlmrl-bench-") as work:
        summary = run_throughput(settings, batches, out, Path(work))
    if is_main_process():
        show.show_throughput(out, summary)
