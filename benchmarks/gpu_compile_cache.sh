# The first step cold and warm (issue 21, item 3): vlmrl's path at the seed recipe (bf16, 1024 tokens), one
# step, twice, in two processes sharing one compile-cache folder that starts empty. The first process compiles
# from scratch and fills the folder; the second reads inductor's FX graph / AOTAutograd / autotune caches and
# Triton's kernels from it (dynamo's tracing and the CUDA-graph recordings are redone: torch caches neither).
# Each bench.json records first_step_seconds and compile_cache.cold. Add --load-in-4bit to measure the 4-bit path.
# Run from the repository root: bash benchmarks/gpu_compile_cache.sh OUTDIR [extra vlmrl bench options]
OUT=${1:-${OUT:-bench-compile-cache}}
shift || true
export PYTHONUNBUFFERED=1
CACHE="$OUT/compile-cache"
rm -rf "$CACHE" && mkdir -p "$CACHE"
for run in cold warm; do
  python3 -m vlmrl.cli bench --paths vlmrl --steps 1 --completion 1024 --compile-cache "$CACHE" \
    --out "$OUT/$run" "$@" || exit 1
done
python3 - "$OUT" <<'PY'
import json, sys
for run in ("cold", "warm"):
    s = json.load(open(f"{sys.argv[1]}/{run}/bench.json"))
    print(run, "cache cold" if s["compile_cache"]["cold"] else "cache warm",
          f"first step {s['paths']['vlmrl']['first_step_seconds']:.1f} s")
PY
