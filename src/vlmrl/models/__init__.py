"""Model loading, LoRA wrapping and offline tiny models (stages 2-3)."""

# The offline tiny builds (models/tiny.py); named here, where importing costs nothing, so the CLI can list them
# without loading transformers.
TINY_ARCHS = ("qwen3_vl", "qwen2_5_vl", "gemma3", "idefics3")
