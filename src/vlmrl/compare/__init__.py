"""The comparison of two evaluations (`stage`) and of the visual control (`visual_gain`): paired deltas with
95% intervals, McNemar, flips. Reads records only; never loads a model."""
