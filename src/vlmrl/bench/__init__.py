"""`vlmrl bench`: plain TRL `GRPOTrainer` and vlmrl's path, side by side, in one process, on one GPU.

Both paths train the same random-weight model with the real shapes of a named model (shipped in
`vlmrl/preflight/shapes/*.json`, no download), the same LoRA (r=16 on language attention + MLP), the same GRPOConfig
(the seed recipe: 8 prompts x 4 generations per step, GSPO) and completions forced to the full length
(`min_new_tokens`), so only the generation path differs:

  plain           `GRPOTrainer` exactly as a user writes it;
  vlmrl           the same trainer after `vlmrl.engine.rollout.fast.enable_fast_generation` (static cache + compiled
                  decode) and `vlmrl.engine.loss.loss_pass.enable_loss_pass`, as `vlmrl train` runs it by default;
  unsloth         Unsloth's `FastVisionModel` (+ `get_peft_model`) under the same trainer, in a process of its
                  own whose first import is unsloth (`unsloth_path`; optional, needs Unsloth and CUDA).
Variants of vlmrl's engine (the adapter merged, the filled-cache window, ...) are not bench paths: benchmark
plugins (benchmarks/variants/) register them in `VARIANTS`, each a callable that sets up the engine on the built
trainer in place of `vlmrl_engine`, and benchmarks/engine_variants.py runs the same command.

Measured per optimizer step: wall time, generation time (decode ms per token step, tokens/s), training
tokens/s, peak GPU memory; and the two floors from ceilings measured on the same device in the same run.
Results go to `bench.json` and a markdown table `bench.md`.

The pieces: `shaped` (settings, the shaped model, the data), `floors` (floors and measured ceilings), `run`
(one path measured, the whole benchmark), `summary` (figures, ratios, markdown tables), `throughput`
(`--generation-batches`: one row per generation batch). This module re-exports what the CLI, the tests and the
scripts under benchmarks/ use; `StepClock` included, since GPU scripts patch its `wrap_generation`.
Left out: the CPU preflight memory estimate (`vlmrl.preflight.memory`, which reuses the floors' counts).
"""

from vlmrl.bench.floors import decode_floor_ms, measure_ceilings, train_floor_s
from vlmrl.bench.run import (
    VARIANTS,
    StepClock,
    path_names,
    path_steps,
    prepare_device,
    prompt_tokens_of,
    run_bench,
    run_path,
    train_and_measure,
    vlmrl_engine,
)
from vlmrl.bench.shaped import (
    GIB,
    LORA_TARGETS,
    PATHS,
    BenchSettings,
    bench_dataset,
    build_processor,
    build_shaped_model,
    free_memory,
    load_shapes,
    save_shaped_model,
    save_weights_once,
    seed_overrides,
)
from vlmrl.bench.summary import (
    SETTING_LABELS,
    markdown_table,
    ratio_prefixes,
    rollouts_per_step,
    scaling_table,
    summarize,
)
from vlmrl.bench.throughput import parse_batches, run_throughput
from vlmrl.bench.unsloth_path import UNSLOTH_PATHS, run_unsloth, unsloth_unavailable_reason
from vlmrl.preflight.memory import kv_bytes_per_token, language_param_count

__all__ = [
    "GIB",
    "LORA_TARGETS",
    "PATHS",
    "SETTING_LABELS",
    "UNSLOTH_PATHS",
    "VARIANTS",
    "BenchSettings",
    "StepClock",
    "bench_dataset",
    "build_processor",
    "build_shaped_model",
    "decode_floor_ms",
    "free_memory",
    "kv_bytes_per_token",
    "language_param_count",
    "load_shapes",
    "markdown_table",
    "measure_ceilings",
    "parse_batches",
    "path_names",
    "path_steps",
    "prepare_device",
    "prompt_tokens_of",
    "ratio_prefixes",
    "rollouts_per_step",
    "run_bench",
    "run_path",
    "run_throughput",
    "run_unsloth",
    "save_shaped_model",
    "save_weights_once",
    "scaling_table",
    "seed_overrides",
    "summarize",
    "train_and_measure",
    "train_floor_s",
    "unsloth_unavailable_reason",
    "vlmrl_engine",
]
