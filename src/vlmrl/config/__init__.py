"""The configuration: one YAML file validated by typed sections (`schema`), read and merged by `load`, the
shipped presets (`presets/*.yaml`) and accelerate files (`accelerate/*.yaml`).

Imports only `vlmrl.common`: every other layer may read a config, a config knows no stage.
"""
