# Does RL teach the GPU demo policy to *read* its figures? (issue 22, docs/learning.md "The GPU demo")
# Builds the demo-gpu policy (timed alone), runs `vlmrl run demo-gpu` (with the swapped-image visual control)
# and the sign-flipped reward control, then writes OUTDIR/h200_visual_learning.json (both comparisons, the
# visual control per family, timings, versions, GPU, the commands) and OUTDIR/h200_visual_learning.md.
# Run from the repository root on the GPU machine:   bash benchmarks/gpu_visual_learning.sh OUTDIR
# CPU smoke of every code path (toy sizes, seconds):  VLMRL_VISUAL_SMOKE=1 bash benchmarks/gpu_visual_learning.sh OUTDIR
# Extra arguments are `section.field=value` overrides for both runs. OUTDIR gets only the result files, the log
# and the two report.html; the run folders and the policy cache go to VLMRL_VISUAL_WORK (default
# /tmp/vlmrl-visual; VLMRL_CACHE defaults to its cache/), never into the repository.
OUT=${1:?usage: bash benchmarks/gpu_visual_learning.sh OUTDIR [section.field=value ...]}; shift
mkdir -p "$OUT" || exit 1
export VLMRL_VISUAL_WORK=${VLMRL_VISUAL_WORK:-/tmp/vlmrl-visual}
export PYTHONUNBUFFERED=1 VLMRL_CACHE=${VLMRL_CACHE:-$VLMRL_VISUAL_WORK/cache}
export PYTHONPATH=${PYTHONPATH:-$PWD/src}
${PYTHON:-python3} benchmarks/visual_learning.py "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
