"""Stage 6: GRPO/GSPO training through TRL's `GRPOTrainer`.

- `stage`       `train(config, run_dir)`: the trainer built, resumed and run
- `args`        the config turned into `GRPOConfig`, and what training refuses before it starts
- `callbacks`   the records (`metrics.jsonl`, `rollouts.jsonl`), health monitors and progress
- `validation`  the held-out evaluation during training, and the best checkpoint
- `trackers`    TensorBoard / W&B / MLflow / trackio callbacks
"""
