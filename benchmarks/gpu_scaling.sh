# Issue 41, several GPUs measured: vlmrl's training step (`vlmrl bench --paths vlmrl`, the seed recipe's shapes,
# 8 prompts x 4 generations per GPU) on 1, 2, 4 and 8 GPUs of one host as lent, under `accelerate launch` with the
# shipped config of each strategy: DDP at the same per-GPU batch (bf16 and 4-bit), FSDP2 with the base sharded, and
# DeepSpeed ZeRO-2; the Qwen3-VL-32B shapes in bf16 under FSDP on 2 GPUs capped at 80 GiB each (an 80 GB card, which
# its recipe does not fit alone; on one uncapped H200 it fits, the reference row); and evaluation sharded over N GPUs
# against one GPU's records. Per configuration: samples/s, scaling efficiency against one GPU, step s, peak memory
# of every GPU beside the preflight's prediction, and the communication share of the step (NCCL kernel time of one
# profiled step, vlmrl.bench.comm). Writes h200_multi_gpu.{json,md} (vlmrl.bench.scaling). The jobs and their
# order: `python3 benchmarks/gpu_scaling.py plan --gpus N`; DDP bf16 at every count, FSDP and ZeRO-2 at the largest,
# the 32B rows and the evaluation first (tier 1, what the issue's "done when" needs), 4-bit next, the counts in
# between last. Tested on the CPU: tests/test_gpu_scaling.py (`rehearse`: the whole plan for a pretend 2-GPU host).
#
# Carried: `.whl` (trl, peft, transformers, bitsandbytes, ... as for the other GPU scripts) and `.whl-deepspeed`
# (DeepSpeed has no wheel on PyPI, only its source; the ZeRO-2 jobs are skipped, and say so, without it). Built
# here once (ignored by git):
#   echo /.whl-deepspeed/ >> .git/info/exclude
#   python3 -m pip download --no-deps --no-binary=:all: -d /tmp/ds deepspeed==0.19.8
#   DS_BUILD_OPS=0 .venv/bin/python -m pip wheel --no-deps --no-build-isolation -w .whl-deepspeed /tmp/ds/deepspeed-0.19.8.tar.gz
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl-deepspeed hjson==3.1.0
#
# The device tool allows 10 minutes a command, 8 files back, 30 minutes of device time a session and 30 minutes
# held per machine, so the jobs run detached (setsid) and each call waits on them. `plan` prints each job's minutes,
# guessed (nothing measured yet): by them tier 1 alone needs more than one session on 2 GPUs, about one on 8.
# Device calls, kind nvidia-h200-x2, -x4 or -x8 (whichever `status` lends), back to back while the machine is warm;
# COMMIT is `git rev-parse HEAD` here (the device has no .git), pasted into the command:
#   1. carry [".whl", ".whl-deepspeed"], timeout_s 600:
#        bash benchmarks/gpu_scaling.sh install && VLMRL_COMMIT=COMMIT bash benchmarks/gpu_scaling.sh start &&
#        bash benchmarks/gpu_scaling.sh wait 530 $OUT
#   2. carry [".whl", ".whl-deepspeed"]:  bash benchmarks/gpu_scaling.sh install && bash benchmarks/gpu_scaling.sh wait 560 $OUT
#   3. the same as 2, while device time lasts (leave 2 minutes: the last call's pack is what comes back).
# Each call brings back OUT/scaling.tar.gz, everything the machine ran so far, and the record so far
# (OUT/h200_multi_gpu.{json,md}). Here, with the last pack of each machine:
#   mkdir -p /tmp/s1 && tar xzf <files_at>/scaling.tar.gz -C /tmp/s1
#   python3 benchmarks/gpu_scaling.py combine /tmp/s1 [/tmp/s2 ...] --out benchmarks/results/h200_multi_gpu
# A later session runs what the record lists under "Not run": `bash benchmarks/gpu_scaling.sh start --only NAME,...`
# (patterns too; a job's dependencies, eval_prep, come with it), the same calls otherwise, and combines its pack
# after the earlier ones (a job's later successful run wins).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
case "${1:-}" in
  install)  # the carried wheels into /tmp/site (each call: a machine may have been given back in between)
    [ -d /tmp/site/trl ] && exit 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl $(ls .whl-deepspeed/*.whl 2>/dev/null) ;;
  *) exec python3 benchmarks/gpu_scaling.py "$@" ;;
esac
