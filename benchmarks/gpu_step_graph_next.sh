# What the recorded token step (vlmrl.engine.rollout.step_graph) has not been measured on yet, one CUDA GPU, one
# part per call (each about 7-9 minutes): bash benchmarks/gpu_step_graph_next.sh OUT PART
#   record   the 4-bit record, vlmrl (the recorded step) beside plain TRL, 24 GiB cap (gpu_record_4bit.sh)
#   bf16     bf16: the product (CUDA graph trees there) against the recorded step opened to bf16
#   stacked  4-bit: the LoRA first factors stacked by shared input (vlmrl-4bit-stacked), which lost before on the
#            host's costs a recorded step no longer has, against the product's PEFT branch
OUT=${1:?usage: bash benchmarks/gpu_step_graph_next.sh OUT record|bf16|stacked}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src:benchmarks
case "$2" in
  record) bash benchmarks/gpu_record_4bit.sh "$OUT" ;;
  bf16) python benchmarks/engine_variants.py bench --paths vlmrl,vlmrl-step-graph-anywhere --steps 2 \
          --completion 1024 --out "$OUT" ;;
  stacked) python benchmarks/engine_variants.py bench --paths vlmrl,vlmrl-4bit-stacked --load-in-4bit \
             --memory-cap-gib 24 --steps 2 --completion 1024 --out "$OUT" ;;
  *) echo "usage: bash benchmarks/gpu_step_graph_next.sh OUT record|bf16|stacked" >&2; exit 2 ;;
esac
