# Unsloth's FastVisionModel beside vlmrl's transformers path (issue 21, item 5): the seed recipe (Qwen3-VL-8B
# shapes, random weights, 8 prompts x 4 generations, 1024 forced tokens, GSPO, LoRA r=16 on the language layers),
# `vlmrl bench --paths unsloth,vlmrl --steps 2`, bf16, then 4-bit under a 24 GiB cap (as gpu_record_4bit.sh).
# The unsloth path runs in a process of its own whose first import is unsloth (src/vlmrl/bench/unsloth_path.py).
#
# Both paths run with Unsloth's pins (trl 1.15.0, datasets 4.8.5, the image's transformers 5.17), installed from
# the carried wheels into their own folder, /tmp/unsloth-site, apart from vlmrl's usual carry (.whl/: trl 1.16,
# datasets 5.2, transformers 5.24, which Unsloth 2026.10.9 does not admit); every record lists its versions.
#
# Before the device calls, here (51.1 MiB of wheels, see benchmarks/unsloth_wheels.txt for the exact command):
#   pip download ... -d .whl-unsloth ...; python benchmarks/slim_unsloth_wheel.py .whl-unsloth/unsloth-*.whl
# Device calls, one path each (a fresh machine installs in under a minute; each bench is cut at 570 s, and the
# paths it finished stay in bench.partial.json). Measured (h200_unsloth_bf16_partial.md): Unsloth's bf16 first
# step alone is 245 s, so both paths of one precision do not fit one 10-minute call:
#   run(command="bash benchmarks/gpu_unsloth.sh $OUT bf16 unsloth", carry=[".whl-unsloth"], timeout_s=600)
#   run(command="bash benchmarks/gpu_unsloth.sh $OUT bf16 vlmrl", carry=[".whl-unsloth"], timeout_s=600)
#   ... and the same with 4bit     -> h200_unsloth_{bf16,4bit}_{unsloth,vlmrl}.json/.md
# Paths run in separate calls are on two machines of one kind, not in one process: the table lists each record
# apart. Without a third argument both paths run in one call (unsloth first) -> h200_unsloth_{bf16,4bit}.json.
# BENCH_TIMEOUT (seconds, default 570) lifts the cut where the bench runs detached, beyond one call
# (several at once on one host); `install` only installs the site (once, before parallel jobs).
# Afterwards, here: copy the h200_unsloth_*.json/.md into benchmarks/results/ and run
#   bash benchmarks/gpu_unsloth.sh benchmarks/results combine   # h200_unsloth.json/.md, every record
set -uo pipefail
OUT=${1:?usage: gpu_unsloth.sh OUTDIR [bf16|4bit|both|combine|install] [PATHS]}
MODE=${2:-both}
PATHS=${3:-unsloth,vlmrl}
case "$PATHS" in
  unsloth,vlmrl|unsloth|vlmrl) ;;
  *) echo "paths: unsloth,vlmrl (the default), unsloth or vlmrl" >&2; exit 2 ;;
esac
SITE=${VLMRL_UNSLOTH_SITE:-/tmp/unsloth-site}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_compiled_cache
mkdir -p "$OUT"

install_site() {
  [ -f "$SITE/unsloth/__init__.py" ] && return 0
  if ! ls .whl-unsloth/*.whl >/dev/null 2>&1; then
    echo "no .whl-unsloth/*.whl here: download them as benchmarks/unsloth_wheels.txt says and carry .whl-unsloth" >&2
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl-unsloth/*.whl
}

bench() {  # $1 = bf16 | 4bit
  local flags=()
  [ "$1" = 4bit ] && flags=(--load-in-4bit --memory-cap-gib 24)
  mkdir -p "$OUT/$1"
  # /dev/shm: the once-saved random bf16 weights (16 GB) are written and read back quickly
  [ -w /dev/shm ] && export TMPDIR=/dev/shm
  local name=h200_unsloth_$1
  [ "$PATHS" = unsloth,vlmrl ] || name=${name}_${PATHS//,/_}
  VLMRL_UNSLOTH_SITE=$SITE PYTHONPATH=$SITE:$PWD/src timeout "${BENCH_TIMEOUT:-570}" python3 -m vlmrl.cli bench --paths "$PATHS" \
    --steps 2 --completion 1024 "${flags[@]}" --out "$OUT/$1" 2>&1 | tee "$OUT/$1/bench.log"
  local rc=$?
  [ -f "$OUT/$1/bench.json" ] && mv "$OUT/$1/bench.json" "$OUT/$name.json" \
    && mv "$OUT/$1/bench.md" "$OUT/$name.md" && rm -f "$OUT/$1/bench.partial.json"
  return $rc
}

combine() {
  python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
# one record per call: bf16, 4bit, or bf16_unsloth, bf16_vlmrl ... when the paths ran in calls of their own
order = {"bf16": 0, "4bit": 1}
names = sorted((p.stem[len("h200_unsloth_"):] for p in out.glob("h200_unsloth_*.json") if not p.stem.endswith("_partial")),
               key=lambda n: (order.get(n.split("_")[0], 2), n))
missing = [n for n in names if not (out / f"h200_unsloth_{n}.md").is_file()]
if missing:
    sys.exit(f"no h200_unsloth_{missing[0]}.md beside its .json in {out}: copy both files of each record")
for precision in ("bf16", "4bit"):
    if precision in names and any(n.startswith(precision + "_") for n in names):
        print(f"note: {out} holds both a {precision} record of both paths and per-path {precision} records; all are kept")
records = {n: json.loads((out / f"h200_unsloth_{n}.json").read_text()) for n in names}
if not records:
    sys.exit(f"no h200_unsloth_bf16*.json / h200_unsloth_4bit*.json in {out}")
(out / "h200_unsloth.json").write_text(json.dumps(records, indent=2))
text = "".join(f"## {p}\n\n" + (out / f"h200_unsloth_{p}.md").read_text() + "\n" for p in records)
(out / "h200_unsloth.md").write_text(text)
print(text)
PY
}

case "$MODE" in
  bf16|4bit) install_site && bench "$MODE"; rc=$?; combine; exit $rc ;;
  both) install_site && bench bf16 && bench 4bit; rc=$?; combine; exit $rc ;;
  combine) combine ;;
  install) install_site ;;
  *) echo "mode: bf16, 4bit, both, combine or install" >&2; exit 2 ;;
esac
