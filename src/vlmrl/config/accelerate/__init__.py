"""accelerate config files for `vlmrl train|eval --gpus N --strategy ddp|fsdp|zero2|zero3` (see
`vlmrl.common.distributed` and docs/multi_gpu.md). Plain accelerate files: `accelerate launch --config_file` takes them
as they are, and a copy is the place to change anything (multi-node settings included)."""
