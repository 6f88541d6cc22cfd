"""The trainer's loss pass, made cheaper with the same numbers: `loss_pass.enable_loss_pass` sets it up on one
trainer.

- `loss_pass`       all-padding columns skipped, micro-batches grouped by length, and `enable_loss_pass` with
                    its record (`LossPass`, `train/summary.json`'s `loss_pass`)
- `kernels`         Liger's fused Triton kernels for RMSNorm, RoPE and the SiLU gate where the model runs
                    eagerly on CUDA
- `adapter_inputs`  LoRA layers keep their bf16 inputs under autocast instead of PEFT's float32 round trip
"""
