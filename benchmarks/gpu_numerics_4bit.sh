# Do the compiled 4-bit rollouts keep the trained policy's numerics? 128 sampled tokens per row, batch 32,
# Qwen3-VL-8B shapes in nf4 with a LoRA adapter: the rollout's log-probs of its own tokens against the loss
# pass's (gradients on) on the same sequences, for the eager (plain TRL's) and the compiled (vlmrl's) decode.
# Needs bitsandbytes. Run from the repository root: bash benchmarks/gpu_numerics_4bit.sh OUTDIR
OUT=${1:-${OUT:-numerics-4bit}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the script runs from benchmarks/
export PYTHONUNBUFFERED=1
cd benchmarks && python3 decode_4bit.py "$OUT" 128 eager-dynamic,compiled && cp "$OUT/decode_4bit.json" "$OUT/h200_numerics_4bit.json"
