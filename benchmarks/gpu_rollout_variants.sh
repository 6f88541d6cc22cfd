# vlmrl's rollout variants beside its default path (issue 21's bf16 decode target), bf16, seed recipe, 1024 forced
# tokens, two steps each, in one process on one GPU: decode ms per token step of each against the same measured
# floor. Default variants: bf16 adapter copies made per rollout instead of the stacked projections (vlmrl-copies)
# and those plus the filled-cache window of 128 (vlmrl-filled-copies); PATHS=... picks others (the path names of
# benchmarks/engine_variants.py, which runs the bench).
# Run from the repository root: bash benchmarks/gpu_rollout_variants.sh OUTDIR (carry .whl; ~7 minutes on an H200).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit 1
fi
OUT=${1:-${OUT:-bench-variants}}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
timeout "${BENCH_TIMEOUT:-570}" python3 benchmarks/engine_variants.py bench --steps 2 --completion 1024 \
  --paths "${PATHS:-vlmrl,vlmrl-copies,vlmrl-filled-copies}" --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/log.txt" | tail -n 20
