# The 4-bit record (issue 21): the seed recipe (Qwen3-VL-8B shapes, bitsandbytes nf4, completion 1024, GSPO,
# LoRA r=16, 8-bit Adam) under a 24 GiB cap, vlmrl's path beside plain TRL in one process. vlmrl runs 2 steps
# (the first compiles), plain TRL 1 (it compiles nothing; one 1024-token step of it takes minutes in 4-bit).
# Needs bitsandbytes. Run from the repository root: bash benchmarks/gpu_record_4bit.sh OUTDIR
# (TMPDIR on a RAM disk makes the once-saved random bf16 weights quick to write and reload.)
OUT=${1:-${OUT:-bench-record-4bit}}
export PYTHONUNBUFFERED=1
python3 -m vlmrl.cli bench --paths vlmrl,plain --load-in-4bit --memory-cap-gib 24 --steps 2 --steps-plain 1 \
  --completion 1024 --out "$OUT" && cp "$OUT/bench.json" "$OUT/h200_record_4bit.json"
