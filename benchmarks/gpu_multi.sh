# Issue "several GPUs", measured on 2 GPUs of one host (docs/multi_gpu.md), in one run:
#  1. evaluation records on 2 GPUs equal a 1-GPU evaluation (greedy, Qwen3-VL-8B shapes, compiled decode);
#  2. samples per second of vlmrl's training step on 1 GPU and on 2 GPUs (DDP) at the same per-GPU batch,
#     peak memory of every GPU.
# Run from the repository root on a machine with 2 CUDA GPUs: bash benchmarks/gpu_multi.sh OUTDIR
set -u
OUT=${1:-${OUT:-multi-out}}; mkdir -p $OUT
W=${VLMRL_WORK:-/tmp/vlmrl-multi}; mkdir -p $W
MODEL=${MODEL:-$W/shaped}            # MODEL=<folder> skips building (the CPU rehearsal passes a tiny one)
COMPLETION=${COMPLETION:-256}
export PYTHONUNBUFFERED=1
[ -f $MODEL/config.json ] || python3 -m vlmrl.cli bench --save-model $MODEL
S="--set model.name=$MODEL --set model.backend=transformers --set model.dtype=auto --set model.max_seq_length=2048
   --set data.image_size=${IMAGE_SIZE:-512} --set data.num_synthetic=80 --set data.holdout_size=16
   --set eval.batch_size=4 --set eval.max_new_tokens=${EVAL_TOKENS:-64} --set eval.do_sample=false
   --set run.output_dir=$W/runs --set run.name=one"
python3 -m vlmrl.cli prepare demo $S > $OUT/eval.log 2>&1 || { tail -20 $OUT/eval.log; exit 1; }
rm -rf $W/runs/two && cp -r $W/runs/one $W/runs/two
# 1-GPU evaluation on the second GPU while the 1-GPU training bench runs on the first
CUDA_VISIBLE_DEVICES=1 python3 -m vlmrl.cli eval demo $S --run-dir $W/runs/one >> $OUT/eval.log 2>&1 &
EVAL1=$!
if [ -z "${SKIP_BENCH:-}" ]; then
  CUDA_VISIBLE_DEVICES=0 python3 -m vlmrl.cli bench --paths vlmrl --steps 3 --completion $COMPLETION \
    --out $OUT/one > $OUT/bench.log 2>&1
fi
wait $EVAL1 || echo "1-GPU eval failed"
python3 -m vlmrl.cli eval demo $S --run-dir $W/runs/two --gpus 2 >> $OUT/eval.log 2>&1 || echo "2-GPU eval failed"
if [ -z "${SKIP_BENCH:-}" ]; then
  CFG=$(python3 -c "from vlmrl.common.distributed import accelerate_config as c; print(c('ddp'))")
  python3 -m accelerate.commands.launch --config_file $CFG --num_processes 2 --num_machines 1 --main_process_port 0 \
    -m vlmrl.cli bench --paths vlmrl --steps 3 --completion $COMPLETION --out $OUT/two >> $OUT/bench.log 2>&1
fi
python3 - $W/runs $OUT <<'PY'
import json, sys
from pathlib import Path
from vlmrl.common.io import read_jsonl
runs, out = Path(sys.argv[1]), Path(sys.argv[2])
def records(run):
    found = sorted(run.rglob("baseline_records.jsonl"))
    return {r["id"]: r for r in read_jsonl(found[0])} if found else {}
one, two = records(runs / "one"), records(runs / "two")
keys = ("completion", "pred", "correct", "format_ok")
same = [i for i in one if i in two and all(one[i].get(k) == two[i].get(k) for k in keys)]
check = {"records_one_gpu": len(one), "records_two_gpus": len(two), "identical": len(same),
         "ids_equal": sorted(one) == sorted(two)}
lines = [f"Eval records: {len(one)} on 1 GPU, {len(two)} on 2 GPUs, ids equal: {check['ids_equal']}, "
         f"identical (completion, extraction, grade, format): {len(same)} of {len(one)}.", ""]
result = {"eval": check}
if (out / "one" / "bench.json").exists() and (out / "two" / "bench.json").exists():
    from vlmrl.bench import scaling_table
    table, figures = scaling_table(json.loads((out / "one" / "bench.json").read_text()),
                                   json.loads((out / "two" / "bench.json").read_text()))
    lines.append(table)
    result["scaling"] = figures
(out / "multi.md").write_text("\n".join(lines))
(out / "multi.json").write_text(json.dumps(result, indent=2))
print("\n".join(lines))
PY
