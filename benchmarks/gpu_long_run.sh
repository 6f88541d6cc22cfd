# Does the compiled rollout stay fast over many steps? (benchmarks/NOTES.md, "Over many steps")
# transformers builds a new static KV cache for every rollout; the CUDA graphs of the compiled decode step are
# recorded against its addresses, and are re-recorded when a new cache lands elsewhere. This runs vlmrl's
# path for 12 steps (short completions, so the run is mostly rollouts), counts the CUDA graphs recorded in each
# rollout, and reports each step's time.
# Run from the repository root: bash benchmarks/gpu_long_run.sh OUTDIR (wheels carried in .whl/ are installed
# first where there is such a folder: the project's GPU machine has no network).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit 1
fi
OUT=${1:-${OUT:-long-run}}; export OUT PYTHONUNBUFFERED=1 VLMRL_CACHE=${VLMRL_CACHE:-/tmp/vc}
mkdir -p $OUT
python3 - > $OUT/log.txt 2>&1 <<'PY'
import os, sys
import torch._inductor.cudagraph_trees as trees
from vlmrl.cli.app import app
from vlmrl import bench

recordings, per_step = [0], []
record = trees.CUDAGraphTreeManager.record_function
def counted(self, *args, **kwargs):  # every CUDA-graph recording, the first ones included
    recordings[0] += 1
    return record(self, *args, **kwargs)
trees.CUDAGraphTreeManager.record_function = counted
generate = bench.StepClock.wrap_generation
def wrap(clock, trainer):  # recordings made during each rollout
    generate(clock, trainer)
    inner = trainer._generate_single_turn
    def rollout(*a, **k):
        before = recordings[0]
        try:
            return inner(*a, **k)
        finally:
            per_step.append(recordings[0] - before)
    trainer._generate_single_turn = rollout
bench.StepClock.wrap_generation = wrap
sys.argv = ["vlmrl", "bench", "--paths", "vlmrl", "--steps", "12", "--completion", "256", "--out", os.environ["OUT"]]
try:
    app()
except SystemExit:
    pass
print("CUDA-graph recordings per rollout:", per_step)
import json
with open(os.path.join(os.environ["OUT"], "recordings.json"), "w") as f:
    json.dump({"cuda_graph_recordings_per_rollout": per_step}, f)
PY
grep "recordings per rollout" $OUT/log.txt
python3 -c "
import json, os; d = json.load(open(os.path.join(os.environ['OUT'], 'bench.json')))
for s in d['raw'][0]['steps']: print(round(s['seconds'], 2), round(s['generate_seconds'], 2))"
