"""The run folder: what lives in it and who may write it.

- `layout`     every file name in a run folder, the fingerprints, and the "is this stage done?" checks
- `claim`      the OS lock one command holds on a run folder, and vlmrl's mark on the folders it made
- `doctor`     stage 1: the environment record (`env.json`)
- `preflight`  the peak-memory prediction and the batch choice before a model is loaded
- `needs`      what a config needs (packages, GPU, files) before the first stage starts
"""
