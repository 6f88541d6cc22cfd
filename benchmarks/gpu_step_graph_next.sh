# What the recorded token step (vlmrl.engine.rollout.step_graph) still needs measured, one CUDA GPU (an H200 for
# the records' targets), one part per call (each about 7-9 minutes): bash benchmarks/gpu_step_graph_next.sh OUT PART
#   check        step_graph_check.py on real CUDA graphs for the other full-attention families (Qwen2.5-VL,
#                SmolVLM), which get the recorded step by the same rule as Qwen3-VL (about 2 minutes)
#   record       the 4-bit record, vlmrl (the recorded step) beside plain TRL, 24 GiB cap (gpu_record_4bit.sh)
#   record-bf16  the bf16 record, plain TRL beside vlmrl (the recorded step there too since commit 14e6891's
#                measurements, claim h100-step-graph-bf16), with the warm-cache step after (gpu_record_bf16.sh)
#   stacked      4-bit: the product (the LoRA first factors stacked by shared input, since commit 14e6891's
#                measurements h100_4bit_stacked_step_graph{,_reversed}: decode 2-4% faster both ways round) against
#                PEFT's own branch per projection (vlmrl-copies), each first once, 3 steps each
#   kernels      the token step's own kernels on the GPU: their GPU tests (group_step, the nf4 kernel with and
#                without the LoRA branch, decode attention, the second step), then skinny_gemm.py's group shapes
#                at 32 rows, the product's group_step against the path before (about 4 minutes)
#   group        bf16: the product (each stacked group's token step one group_step kernel) against the path before
#                (vlmrl-group-apart: cuBLAS's stacked matmul, then the second-step kernel), one process, 2 steps
OUT=${1:?usage: bash benchmarks/gpu_step_graph_next.sh OUT check|record|record-bf16|stacked|kernels|group}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src:benchmarks
case "$2" in
  check) for A in qwen2_5_vl idefics3; do python benchmarks/step_graph_check.py "$OUT" 24 2 $A || exit 1; done ;;
  record) bash benchmarks/gpu_record_4bit.sh "$OUT" ;;
  record-bf16) bash benchmarks/gpu_record_bf16.sh "$OUT" ;;
  stacked) for P in vlmrl,vlmrl-copies vlmrl-copies,vlmrl; do
             python benchmarks/engine_variants.py bench --paths $P --load-in-4bit --memory-cap-gib 24 --steps 3 \
               --completion 1024 --out "$OUT/${P%%,*}-first"
           done ;;
  kernels) python -m pytest -q -p no:cacheprovider tests/test_group_step.py tests/test_nf4_branch.py \
             tests/test_decode_attention.py tests/test_second_factors.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
           python -m pytest -q -p no:cacheprovider -m gpu tests/test_nf4.py 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -5
           python benchmarks/skinny_gemm.py "$OUT" 32 --no-sweep ;;
  group) python benchmarks/engine_variants.py bench --paths vlmrl,vlmrl-group-apart --steps 2 --completion 1024 \
           --out "$OUT/group" ;;
  *) echo "usage: bash benchmarks/gpu_step_graph_next.sh OUT check|record|record-bf16|stacked|kernels|group" >&2; exit 2 ;;
esac
