# The bf16 benchmark of record (benchmarks/NOTES.md): plain TRL vs vlmrl's default rollout path, and plain TRL vs
# the merged path (an experiment: benchmarks/engine_variants.py), each pair in one process. With two GPUs the pairs run side by side (one GPU each; the
# bench wants one GPU per process); with one, one after the other (about 8 minutes each on an H200).
# Run from the repository root: bash benchmarks/gpu_bench_bf16.sh OUTDIR (wheels carried in .whl/ are installed
# first where there is such a folder: the project's GPU machine has no network).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit 1
fi
OUT=${1:-${OUT:-bench-bf16}}
export PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, trl, peft, datasets, pyarrow; print(torch.__version__, transformers.__version__, trl.__version__, peft.__version__, datasets.__version__, pyarrow.__version__, torch.cuda.get_device_name(0))"
bench() {  # $1 GPU, $2 paths, $3 output folder
  mkdir -p "$3"
  CUDA_VISIBLE_DEVICES=$1 VLMRL_CACHE=/tmp/vc$1 timeout ${BENCH_TIMEOUT:-3000} python3 benchmarks/engine_variants.py bench --steps 2 \
    --completion 1024 --paths "$2" --out "$3" 2>&1 | grep -v Warning > "$3/log.txt"
}
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  bench 0 plain,vlmrl $OUT/default & bench 1 plain,vlmrl-merged $OUT/merged; wait
else
  bench 0 plain,vlmrl $OUT/default; bench 0 plain,vlmrl-merged $OUT/merged
fi
tail -n 6 $OUT/default/log.txt $OUT/merged/log.txt
