# Diagnostic for the remaining decode gap (benchmarks/NOTES.md): vlmrl path only, short completions,
# with torch.compile's recompile log. Not a benchmark of record.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit 1
export PYTHONUNBUFFERED=1 VLMRL_CACHE=/tmp/vc TORCH_LOGS=recompiles,graph_breaks
python3 -m vlmrl.cli bench --paths vlmrl --steps 3 --completion 256 --out $OUT > $OUT/log.txt 2>&1
grep -ciE "recompil" $OUT/log.txt; grep -iE "recompil|graph break" $OUT/log.txt | sort | uniq -c | sort -rn | head -30
cat $OUT/bench.md
