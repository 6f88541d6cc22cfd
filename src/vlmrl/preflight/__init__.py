"""Before a run: what this machine has and whether a config fits it. Reads and writes no run folder.

- `doctor`   stage 1: the environment record (`env.json`)
- `memory`   the peak-memory prediction and the batch choice before a model is loaded, over the shipped model
             shapes (`shapes/*.json`)
- `needs`    what a config needs (packages, GPU, files) before the first stage starts
"""
