"""The run folder: what lives in it and who may write it.

- `layout`     every file name in a run folder, the fingerprints, and the "is this stage done?" checks
- `claim`      the OS lock one command holds on a run folder, and vlmrl's mark on the folders it made

What is checked before a run (the environment, the memory preflight, a config's needs) is `vlmrl.preflight`.
"""
