# The 4-bit record (issue 21): the seed recipe (Qwen3-VL-8B shapes, bitsandbytes nf4, completion 1024, GSPO,
# LoRA r=16, 8-bit Adam) under a 24 GiB cap, vlmrl's path beside plain TRL in one process. vlmrl runs 2 steps
# (the first compiles), plain TRL 1 (it compiles nothing; one 1024-token step of it takes minutes in 4-bit).
# Needs bitsandbytes. Run from the repository root: bash benchmarks/gpu_record_4bit.sh OUTDIR
# (TMPDIR on a RAM disk makes the once-saved random bf16 weights quick to write and reload.)
# PATHS / STEPS: the paths measured (default vlmrl,plain; a name from benchmarks/engine_variants.py runs through
# that script) and vlmrl's steps (default 2; the first is set apart).
OUT=${1:-${OUT:-bench-record-4bit}}
export PYTHONUNBUFFERED=1
BENCH="python3 -m vlmrl.cli"
case ",${PATHS:-}," in *,vlmrl-*) BENCH="python3 benchmarks/engine_variants.py" ;; esac
$BENCH bench --paths "${PATHS:-vlmrl,plain}" --load-in-4bit --memory-cap-gib 24 --steps "${STEPS:-2}" --steps-plain 1 \
  --completion 1024 --out "$OUT" && cp "$OUT/bench.json" "$OUT/h200_record_4bit.json"
