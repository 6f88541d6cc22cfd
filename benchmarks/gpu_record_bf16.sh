# The bf16 record (issue 21): plain TRL vs vlmrl's default path (adapter not merged), seed recipe, 1024 forced
# tokens, 2 steps each, one process, with an empty compile cache (so vlmrl's first step is the cold one); then
# vlmrl alone for one step in a second process reading that cache (the warm first step).
# Run from the repository root: bash benchmarks/gpu_record_bf16.sh OUTDIR (one GPU per process:
# CUDA_VISIBLE_DEVICES=0 on a multi-GPU host). About 8 minutes on an H200.
OUT=${1:-${OUT:-bench-record-bf16}}
export PYTHONUNBUFFERED=1
CACHE=$(mktemp -d /tmp/vlmrl-compile-cache.XXXX)  # outside OUT: thousands of small files
# STEPS / STEPS_PLAIN / WARMUP: steps per path and how many are set apart (vlmrl bench --warmup-steps); the
# second step still does one-off work, so e.g. STEPS=4 STEPS_PLAIN=3 WARMUP=2 (about 13 minutes: run it detached).
# PATHS: the paths measured in the record's process (default plain,vlmrl), e.g. with an engine variant beside them
# (a name from benchmarks/engine_variants.py: the record then runs through that script, the same bench otherwise).
BENCH="python3 -m vlmrl.cli"
case ",${PATHS:-}," in *,vlmrl-*) BENCH="python3 benchmarks/engine_variants.py" ;; esac
$BENCH bench --paths "${PATHS:-plain,vlmrl}" --steps "${STEPS:-2}" --warmup-steps "${WARMUP:-1}" \
  ${STEPS_PLAIN:+--steps-plain "$STEPS_PLAIN"} --completion 1024 --compile-cache "$CACHE" \
  --out "$OUT/record" && cp "$OUT/record/bench.json" "$OUT/h200_record.json" || exit 1
[ "${WARM:-1}" = 0 ] && exit 0  # WARM=0: the record alone, without the warm first step
python3 -m vlmrl.cli bench --paths vlmrl --steps 1 --completion 1024 --compile-cache "$CACHE" --out "$OUT/warm" \
  && cp "$OUT/warm/bench.json" "$OUT/h200_compile_cache_warm.json"
python3 - "$OUT" <<'PY'
import json, sys
for name in ("h200_record", "h200_compile_cache_warm"):
    try:
        s = json.load(open(f"{sys.argv[1]}/{name}.json"))
    except OSError:
        continue
    print(name, "cache cold" if s["compile_cache"]["cold"] else "cache warm",
          f"vlmrl first step {s['paths']['vlmrl']['first_step_seconds']:.1f} s")
PY
