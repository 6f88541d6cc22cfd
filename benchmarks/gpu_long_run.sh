# Does the compiled rollout stay fast over many steps? (docs/benchmarks.md, "Over many steps")
# transformers builds a new static KV cache for every rollout; the CUDA graphs of the compiled decode step are
# recorded against its addresses, and are re-recorded when a new cache lands elsewhere. This runs vlmrl's
# path for 12 steps (short completions, so the run is mostly rollouts) with the CUDA-graph tree's debug log on,
# and reports each step's time and how many re-recordings happened.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit 1
export PYTHONUNBUFFERED=1 VLMRL_CACHE=/tmp/vc
mkdir -p $OUT
python3 - > $OUT/log.txt 2>&1 <<'PY'
import logging, os, sys
logging.basicConfig(level=logging.WARNING)
logging.getLogger("torch._inductor.cudagraph_trees").setLevel(logging.DEBUG)
from vlmrl.cli import app
sys.argv = ["vlmrl", "bench", "--paths", "vlmrl", "--steps", "12", "--completion", "256", "--out", os.environ["OUT"]]
app()
PY
echo "re-recordings: $(grep -c 'Re-recording' $OUT/log.txt)"; grep 'Re-recording' $OUT/log.txt | sed 's/.*reason=//' | cut -c1-160 | sort | uniq -c | head
python3 -c "
import json, os; d = json.load(open(os.path.join(os.environ['OUT'], 'bench.json')))
for s in d['raw'][0]['steps']: print(round(s['seconds'], 2), round(s['generate_seconds'], 2))"
