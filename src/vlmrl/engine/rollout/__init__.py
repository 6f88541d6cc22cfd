"""The rollout engine: how vlmrl generates completions, in training and in evaluation, faster than plain TRL.

The pieces, and where each is switched on:

  fast           the fast path inside TRL's trainer (static KV cache, compiled decode, rollout autocast, prompt
                 pass on a dynamic cache, stop check one step late): `fast.enable_fast_generation(trainer)`,
                 called by `vlmrl train` when `train.rollout.fast` says so (`fast.wanted`: `auto` = on CUDA)
                 and by `vlmrl bench` for its vlmrl path; the cache bucket is `train.rollout.prompt_bucket`.
  attention      `vlmrl_sdpa`, grouped-query attention without KV copies; swapped in for each rollout by `fast`
                 and for compiled decoding by `generation`.
  decode_attention  a Triton kernel for a token step's attention that skips the cache blocks nothing attends to;
                 `attention` runs it inside rollouts and compiled decoding (`train.rollout.kernels`).
  finished       rows that have met their end-of-sequence token attend to their own position only at later token
                 steps, so the decode kernel reads one block of their cache; on wherever the decode kernel is.
  stacked        projections that read the same input (q/k/v, gate/up) run in rollouts as one matmul with their
                 adapters' first factors, one for the second; the base weights moved once into stacked tensors.
                 Wherever it applies.
  second_factors the stacked groups' second step as one Triton kernel at token steps (`train.rollout.kernels`).
  group_step     a bf16 stacked group's whole token step (matmul over base and first-factor rows, second step) as
                 one split-K Triton kernel, where in_features is a multiple of 128 (`train.rollout.kernels`).
  nf4_branch     over a 4-bit base, each projection's base and LoRA branch in one launch of the nf4 kernel.
  arrivals       the per-tile counters with which a kernel's last split sums the others' shares.
  nf4            a Triton kernel for token steps over bitsandbytes nf4 weights: `fast` routes a 4-bit base's
                 `Linear4bit` forwards of 2-64 rows without gradients through it for the trainer's life, on the
                 GPUs where it was measured faster (`nf4.gpu_reason`) and `train.rollout.kernels` is on;
                 bitsandbytes otherwise, the reason recorded. Its Triton source is `nf4_triton`.
  step_graph     each rollout's token step recorded once as one CUDA graph and replayed without dynamo's guard
                 checks; `fast` turns it on where it was measured (an unquantized base, a 4-bit one on the nf4 kernel)
                 and goes back to torch.compile's CUDA graph trees for good if a step cannot be recorded.
  adapter_cast   bf16 copies of the float32 LoRA weights, made for each rollout where stacking does not apply.
  offload        the optimizer state in host memory while a rollout runs, which pays for those copies.
  sampling       the sampler's log-prob of every sampled token, returned to TRL as vLLM's are
                 (`sampling_per_token_logps`), fast path or plain.
  mismatch       those against the loss pass's, per optimizer step (metrics, health), and truncated importance
                 sampling when `train.rollout_correction` resolves to `tis`; `vlmrl train` and `vlmrl bench`
                 install it after the fast path and the loss pass.
  generation     batched image+question `generate` for evaluation, validation, the SFT check and the demo
                 policy (and the prompt encoding export checks use); compiled (static cache + `attention` +
                 deferred stop check) when `eval.compile` says so.
  sharded        under FSDP2, the root unit gathered around each of TRL's rollouts (TRL generates past the root's
                 forward): `sharded.gather_root_in_rollouts(trainer)`, called by train and bench before `fast`.
  compile_cache  torch.compile's on-disk caches under vlmrl's cache folder: `use_compile_cache()`, called by
                 train, compiled eval and bench (`vlmrl bench --compile-cache DIR`) before anything compiles.

Nothing is imported here: each piece pulls in torch/transformers itself, when it is imported. Left out: vLLM,
anything that changes TRL's loss pass (the TIS factor goes through TRL's own multiplication), and the experiments
(benchmark plugins in benchmarks/variants/: the adapter merge, the filled-cache window, guards checked once). What each piece is worth: benchmarks/NOTES.md.
"""
