python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit 1
export PYTHONUNBUFFERED=1 VLMRL_CACHE=/tmp/vc
python3 -c "import torch, transformers, trl, peft, datasets, pyarrow; print(torch.__version__, transformers.__version__, trl.__version__, peft.__version__, datasets.__version__, pyarrow.__version__, torch.cuda.get_device_name(0))"
python3 -m vlmrl.cli bench --steps 2 --completion 1024 --paths plain,vlmrl,vlmrl-merged --out $OUT 2>&1 | grep -v Warning | tee $OUT/log.txt
