"""Model loading, LoRA wrapping and offline tiny models (stages 2-3)."""

# The offline tiny builds (models/tiny.py); named here, where importing costs nothing, so the CLI can list them
# without loading transformers.
TINY_ARCHS = ("qwen3_vl", "qwen2_5_vl", "gemma3", "idefics3")
# The policies vlmrl builds itself by supervised warm start (models/demo.py): the CPU demo's, the GPU demo's,
# and the GPU demo's recipe scaled down so its whole path runs on a CPU (benchmarks/gpu_visual_learning.sh).
DEMO_POLICIES = ("demo-policy", "demo-policy-gpu", "demo-policy-gpu-smoke")
