"""The base models vlmrl builds itself, offline, which no hub hosts: `tiny:<arch>` (random weights, for tests
and smoke runs; built by `vlmrl.models.tiny`) and the demo policies (a tiny model given a short supervised warm
start; `vlmrl.models.demo`). Named here, where importing costs nothing, so the CLI can list them and the
preflight can tell them from a hub id without loading transformers. Public: `TINY_ARCHS`, `DEMO_POLICIES`,
`is_local_only`."""

TINY_ARCHS = ("qwen3_vl", "qwen2_5_vl", "gemma3", "idefics3")
# the CPU demo's policy, the GPU demo's, and the GPU demo's recipe scaled down so its whole path runs on a CPU
# (benchmarks/gpu_visual_learning.sh)
DEMO_POLICIES = ("demo-policy", "demo-policy-gpu", "demo-policy-gpu-smoke")


def is_local_only(model_name: str) -> bool:
    """True for the bases vlmrl builds itself offline (`tiny:<arch>`, `demo-policy`), which no hub hosts.

    >>> is_local_only("tiny:qwen3_vl"), is_local_only("demo-policy"), is_local_only("Qwen/Qwen3-VL-8B-Instruct")
    (True, True, False)
    """
    return model_name.startswith("tiny:") or model_name in DEMO_POLICIES
