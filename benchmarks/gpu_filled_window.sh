# The opt-in filled-cache window (train.rollout_filled_window; issue 21's bf16 decode target) beside vlmrl's default
# path, bf16, seed recipe, 1024 forced tokens, two steps each, in one process on one GPU: decode ms per token step
# of both against the same measured floor. Not yet run (written in a session without device time).
# Run from the repository root: bash benchmarks/gpu_filled_window.sh OUTDIR (carry .whl; ~5 minutes on an H200).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit 1
fi
OUT=${1:-${OUT:-bench-filled}}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
timeout "${BENCH_TIMEOUT:-570}" python3 -m vlmrl.cli bench --steps 2 --completion 1024 --paths vlmrl,vlmrl-filled \
  --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/log.txt" | tail -n 20
