"""Model loading, LoRA wrapping and offline tiny models (stages 2-3)."""
