"""The engine: how completions are generated (`rollout/`) and scored by the trainer's loss pass (`loss/`:
`loss_pass`, with Liger's fused kernels in `kernels` and the LoRA input dtype in `adapter_inputs`);
`lora_layers` finds PEFT's LoRA layers for both. The A/B variants that lost or tied are benchmark plugins
(benchmarks/variants/), outside the package.

Knows models as torch modules only: it imports no config, data, grading or stage.
"""
