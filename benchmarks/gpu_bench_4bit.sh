# The seed's 4-bit recipe (Qwen3-VL-8B shapes, bitsandbytes nf4, completion 1024, GSPO, LoRA r=16, 8-bit Adam):
# 3 optimizer steps of vlmrl's path with the process capped at 24 GiB (torch.cuda.set_per_process_memory_fraction).
# Needs bitsandbytes. Run from the repository root: bash benchmarks/gpu_bench_4bit.sh OUTDIR
OUT=${1:-${OUT:-bench-4bit}}
export PYTHONUNBUFFERED=1
python3 -m vlmrl.cli bench --paths vlmrl --load-in-4bit --memory-cap-gib 24 --steps 3 --completion 1024 --out $OUT
