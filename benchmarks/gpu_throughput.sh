# Samples/s and peak memory by generation batch (issue 21, item 4): vlmrl's path at the seed recipe (1024 forced
# tokens, 4 generations per prompt, gradient accumulation 4, so per-device batch = generation batch / 4), 2 steps
# per batch (the first compiles for the batch's shapes and is reported apart), bf16 then 4-bit. One process per
# precision; a batch that runs out of memory is recorded and the larger ones skipped.
# Run from the repository root: bash benchmarks/gpu_throughput.sh OUTDIR [bf16|4bit|both]   (BATCHES=32,64 to run
# fewer at once: each batch takes a compile plus two steps, several minutes at 256). One precision per GPU:
# two GPUs can run the two precisions side by side.
OUT=${1:-${OUT:-bench-throughput}}
MODE=${2:-both}
BATCHES=${BATCHES:-32,64,128,256}
export PYTHONUNBUFFERED=1
# /dev/shm: the 4-bit pass saves the random bf16 weights (16 GB) once and reloads them for each batch
[ -w /dev/shm ] && export TMPDIR=/dev/shm
case "$MODE" in
  bf16|4bit|both) ;;
  *) echo "mode: bf16, 4bit or both" >&2; exit 2 ;;
esac
rc=0
if [ "$MODE" != 4bit ]; then
  python3 -m vlmrl.cli bench --paths vlmrl --generation-batches "$BATCHES" --steps 2 --completion 1024 \
    --out "$OUT/bf16" || rc=$?
fi
if [ "$MODE" != bf16 ]; then
  python3 -m vlmrl.cli bench --paths vlmrl --generation-batches "$BATCHES" --steps 2 --completion 1024 \
    --load-in-4bit --out "$OUT/4bit" || rc=$?
fi
exit $rc
