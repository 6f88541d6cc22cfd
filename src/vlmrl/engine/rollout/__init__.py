"""The rollout engine: how vlmrl generates completions, in training and in evaluation, faster than plain TRL.

The pieces, and where each is switched on:

  fast           the fast path inside TRL's trainer (static KV cache, compiled decode, rollout autocast, prompt
                 pass on a dynamic cache, stop check one step late): `fast.enable_fast_generation(trainer)`,
                 called by `vlmrl train` when `train.fast_generation` says so (`fast.wanted`: `auto` = on CUDA)
                 and by `vlmrl bench` for its vlmrl paths; the cache bucket is `train.prompt_bucket`.
  attention      `vlmrl_sdpa`, grouped-query attention without KV copies; swapped in for each rollout by `fast`
                 and for compiled decoding by `generation`.
  decode_attention  a Triton kernel for a token step's attention that skips the cache blocks nothing attends to;
                 `attention` runs it inside rollouts (`train.rollout_decode_kernel`, on) and compiled decoding.
  merge          the LoRA adapter merged into the weights for each rollout, restored exactly afterwards:
                 opt-in, `train.rollout_merge=true` (bench path `vlmrl-merged`).
  adapter_cast   bf16 copies of the float32 LoRA weights, made for each rollout (`train.rollout_adapter_copies`, on)
                 where the stacked projections do not apply.
  stacked        projections that read the same input (q/k/v, gate/up) run in rollouts as one matmul with their
                 adapters' first factors, one for the second: 8 matmuls per layer instead of 21; the base weights
                 moved once into stacked tensors; on by default, `train.rollout_stacked` (bench path `vlmrl-stacked`).
  offload        the optimizer state in host memory while a rollout runs, which pays for those copies.
  generation     batched image+question `generate` for evaluation, validation, the SFT check and the demo
                 policy (and the prompt encoding export checks use); compiled (static cache + `attention` + deferred stop check) when
                 `eval.compile` says so (`vlmrl eval`, `evaluate.py`).
  compile_cache  torch.compile's on-disk caches under vlmrl's cache folder: `use_compile_cache()`, called by
                 train, compiled eval and bench (`vlmrl bench --compile-cache DIR`) before anything compiles.

Nothing is imported here: each piece pulls in torch/transformers itself, when it is imported. Left out: vLLM
(TRL offers importance-sampling correction to vLLM only; see `merge`) and anything that changes TRL's loss pass.
"""
