# The token step recorded as one CUDA graph per rollout (the product's, vlmrl.engine.rollout.step_graph, on a 4-bit
# base on the nf4 kernel) against torch.compile's CUDA graph trees (bench path vlmrl-graph-trees), 4-bit under a
# 24 GiB cap: first the tokens of a tiny Qwen3-VL each way (step_graph_check.py), then a timeline of token steps
# 64-71 per path (wall against GPU-busy time, a process each), then the product's nf4 GPU tests, then guards
# checked once (over the graph trees). Each step's output goes to OUT as it finishes; OUT/DONE at the end.
# (Before the recorded step was the product's, the same plan ran it as bench path vlmrl-step-graph against vlmrl.)
# Needs bitsandbytes. Run from the repository root: bash benchmarks/gpu_step_graph.sh OUT
OUT=${1:?usage: bash benchmarks/gpu_step_graph.sh OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src:benchmarks
timeout 150 python benchmarks/step_graph_check.py "$OUT/check" 24 2 > "$OUT/check.log" 2>&1
for P in vlmrl vlmrl-graph-trees; do
  timeout 200 python benchmarks/token_step_timeline.py "$OUT/$P" --path "$P" --load-in-4bit --memory-cap-gib 24 \
    --completion 1024 --token-step 64 --steps 8 > "$OUT/$P.log" 2>&1
done
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_nf4.py tests/test_variants.py -m gpu -k "nf4 or bytes" \
  > "$OUT/gpu_tests.log" 2>&1
timeout 200 python benchmarks/token_step_timeline.py "$OUT/vlmrl-guards-once" --path vlmrl-guards-once --load-in-4bit \
  --memory-cap-gib 24 --completion 1024 --token-step 64 --steps 8 > "$OUT/vlmrl-guards-once.log" 2>&1
touch "$OUT/DONE"
