"""`vlmrl bench`: plain TRL `GRPOTrainer` and vlmrl's path, side by side, in one process, on one GPU.

Both paths train the same random-weight model with the real shapes of a named model (shipped in
`vlmrl/shapes/*.json`, no download), the same LoRA (r=16 on language attention + MLP), the same GRPOConfig
(the seed recipe: 8 prompts x 4 generations per step, GSPO) and completions forced to the full length
(`min_new_tokens`), so only the generation path differs:

  plain           `GRPOTrainer` exactly as a user writes it;
  vlmrl           the same trainer after `vlmrl.engine.rollout.fast.enable_fast_generation` (static cache + compiled
                  decode), as `vlmrl train` runs it by default;
  vlmrl-merged    vlmrl with the adapter merged into the weights for rollouts (`train.rollout_merge=true`,
                  opt-in; optional);
  vlmrl-filled    vlmrl whose decode attention reads only the filled cache positions, in windows of 128
                  (`train.rollout_filled_window=128`, opt-in; optional);
  vlmrl-copies    vlmrl whose rollouts read bf16 copies of the adapter weights instead of the stacked projections,
                  the optimizer state on the host meanwhile (`train.rollout_stacked=false`, the default before;
                  optional);
  vlmrl-filled-copies  both of the last two (optional);
  vlmrl-input-cast     vlmrl whose LoRA layers cast their inputs to float32 under autocast, as PEFT does
                  (`train.adapter_input_cast=true`; optional);
  vlmrl-sdpa-decode    vlmrl whose token steps attend through PyTorch's SDPA over the whole static cache instead
                  of vlmrl's Triton kernel (`train.rollout_decode_kernel=false`; optional);
  vlmrl-own-kernels    vlmrl whose loss pass runs the language model's RMSNorm, RoPE and SiLU gate as the
                  modules' own PyTorch code instead of Liger's kernels (`train.loss_kernels=false`; optional);
  vlmrl-stacked   vlmrl whose rollouts run each group of LoRA projections that read the same input as one
                  matmul with the adapters' first factors (`train.rollout_stacked=true`, the default now; the
                  path that measured it beside the copies; optional);
  vlmrl-guards-once  vlmrl whose compiled token steps check dynamo's guards at the first step of each rollout
                  only (`train.rollout_guards="first step"`, opt-in; optional);
  vlmrl-stacked-kernel  vlmrl whose token steps run each stacked group's second step as one Triton kernel
                  (`train.rollout_stacked_kernel=true`, the default now; the path that measured it; optional);
  vlmrl-second-cublas  vlmrl whose token steps run that second step as a cuBLAS matmul and a sum
                  (`train.rollout_stacked_kernel=false`, the default before; optional);
  unsloth         Unsloth's `FastVisionModel` (+ `get_peft_model`) under the same trainer, in a process of its
                  own whose first import is unsloth (`unsloth_path`; optional, needs Unsloth and CUDA).

Measured per optimizer step: wall time, generation time (decode ms per token step, tokens/s), training
tokens/s, peak GPU memory; and the two floors from ceilings measured on the same device in the same run.
Results go to `bench.json` and a markdown table `bench.md`.

The pieces: `shaped` (settings, the shaped model, the data), `floors` (floors and measured ceilings), `run`
(one path measured, the whole benchmark), `summary` (figures, ratios, markdown tables), `throughput`
(`--generation-batches`: one row per generation batch). This module re-exports what the CLI, the tests and the
scripts under benchmarks/ use; `_StepClock` included, since GPU scripts patch its `wrap_generation`.
Left out: the CPU preflight memory estimate (`vlmrl.run.preflight`, which reuses the floors' counts).
"""

from vlmrl.bench.floors import decode_floor_ms, measure_ceilings, train_floor_s
from vlmrl.bench.run import (
    _StepClock,
    path_steps,
    prepare_device,
    prompt_tokens_of,
    run_bench,
    run_path,
    train_and_measure,
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
)
from vlmrl.bench.summary import RATIO_PREFIXES, SETTING_LABELS, markdown_table, scaling_table, summarize
from vlmrl.bench.throughput import parse_batches, run_throughput
from vlmrl.bench.unsloth_path import UNSLOTH_PATHS, run_unsloth, unsloth_unavailable_reason
from vlmrl.run.preflight import kv_bytes_per_token, language_param_count

__all__ = [
    "GIB",
    "LORA_TARGETS",
    "PATHS",
    "RATIO_PREFIXES",
    "SETTING_LABELS",
    "UNSLOTH_PATHS",
    "BenchSettings",
    "_StepClock",
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
    "path_steps",
    "prepare_device",
    "prompt_tokens_of",
    "run_bench",
    "run_path",
    "run_throughput",
    "run_unsloth",
    "save_shaped_model",
    "save_weights_once",
    "scaling_table",
    "summarize",
    "train_and_measure",
    "train_floor_s",
    "unsloth_unavailable_reason",
]
