"""Model loading (`loading`), LoRA wrapping (`lora`), the demo policies and their supervised warm start
(`demo`, `warm_start`), and the offline tiny builds, one module per family (`tiny*`)."""

from vlmrl.config.builtin_models import DEMO_POLICIES, TINY_ARCHS

__all__ = ["DEMO_POLICIES", "TINY_ARCHS"]
