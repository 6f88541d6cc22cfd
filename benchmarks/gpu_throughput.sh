# Samples/s and peak memory by generation batch (issue 21, item 4): vlmrl's path at the seed recipe (1024 forced
# tokens, 4 generations per prompt, gradient accumulation 4, so per-device batch = generation batch / 4), 2 steps
# per batch (the first compiles for the batch's shapes and is reported apart), bf16 then 4-bit. One process per
# precision; a batch that runs out of memory is recorded and the larger ones skipped.
# Run from the repository root: bash benchmarks/gpu_throughput.sh OUTDIR   (BATCHES=32,64 to run fewer at once:
# each batch takes a compile plus two steps, several minutes at 256)
OUT=${1:-${OUT:-bench-throughput}}
BATCHES=${BATCHES:-32,64,128,256}
export PYTHONUNBUFFERED=1
python3 -m vlmrl.cli bench --paths vlmrl --generation-batches "$BATCHES" --steps 2 --completion 1024 --out "$OUT/bf16"
python3 -m vlmrl.cli bench --paths vlmrl --generation-batches "$BATCHES" --steps 2 --completion 1024 --load-in-4bit \
  --out "$OUT/4bit"
