"""Stage 6: GRPO/GSPO training through TRL's `GRPOTrainer`.

- `stage`       `train(config, run_dir)`: the trainer built, resumed and run
- `trainer_build` `GRPOConfig`, the dataset and `GRPOTrainer` with vlmrl's callbacks and engine
- `args`        what training refuses before it starts (`vlmrl config validate` shares it)
- `callbacks`   the records (`metrics.jsonl`, `rollouts.jsonl`), health monitors and progress
- `validation`  the held-out evaluation during training, and the best checkpoint
- `trackers`    TensorBoard / W&B / MLflow / trackio callbacks
"""
