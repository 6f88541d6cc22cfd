# Several benchmark jobs at once on a host of several GPUs, one queue per GPU, carried over several device calls.
#
# Why: issue 21's remaining measurements (Unsloth's four rows, the bf16 and 4-bit batch tables) take about
# 50 GPU-minutes in sequence, more than one session's device time, while on a 4-GPU host they take ~17 minutes of
# wall time. One device call is capped at 10 minutes and a machine goes back ~30 s after a call ends, so the jobs
# run detached (setsid; they survive the call) and each following call waits on them, then packs what finished.
#
#   bash benchmarks/gpu_parallel.sh start PLAN [ONLY] start PLAN's queues (one per GPU index; jobs in file order);
#                                                    ONLY (e.g. 0,1 or 'unsloth_*') starts only the lines whose GPU
#                                                    index or job name matches one of its comma-separated patterns
#   bash benchmarks/gpu_parallel.sh wait SECONDS OUT until every job started has ended or SECONDS passed; then a
#                                                    status table, the failed jobs' log tails, and OUT/parallel.tar.gz
#                                                    (every job's JOB_OUT files under 4 MB, and its log's last 400 lines)
#   bash benchmarks/gpu_parallel.sh status           the table alone
#
# A plan line is `GPU NAME COMMAND...`: COMMAND runs under bash from the repository root with
# CUDA_VISIBLE_DEVICES=GPU and JOB_OUT=<state>/out/NAME (an empty folder for its results); `#` starts a comment.
# `start` may be called again (e.g. after a second carry of wheels): a queue for a GPU that already has one waits
# until that one has finished (a lock folder per GPU), so one GPU never runs two jobs at once.
# The state folder is $VLMRL_PARALLEL_STATE (default /tmp/vlmrl-parallel). The plan of issue 21:
# benchmarks/gpu_issue21.plan (its header has the device calls). Lab tooling: no tests with the product.
set -uo pipefail
STATE=${VLMRL_PARALLEL_STATE:-/tmp/vlmrl-parallel}
cmd=${1:?usage: gpu_parallel.sh start PLAN [ONLY] | wait SECONDS OUT | status}

queue() {  # $1 = GPU index, $2 = file of "NAME<TAB>COMMAND" lines: run them one after the other
  local gpu=$1 name command start rc
  until mkdir "$STATE/locks/gpu$gpu" 2>/dev/null; do sleep 2; done   # the GPU's earlier queue goes first
  while IFS=$'\t' read -r name command; do
    mkdir -p "$STATE/out/$name"
    start=$(date +%s)
    echo "$gpu $start" > "$STATE/run/$name"
    (cd "$ROOT" && CUDA_VISIBLE_DEVICES=$gpu JOB_OUT=$STATE/out/$name bash -c "$command") \
      > "$STATE/logs/$name.log" 2>&1 < /dev/null
    rc=$?
    echo "$rc $(( $(date +%s) - start ))" > "$STATE/rc/$name"
  done < "$2"
  rmdir "$STATE/locks/gpu$gpu"
}

table() {  # prints the jobs' state; returns 0 when every job has ended
  local name gpu rest rc secs pending=0
  printf '%-28s %-4s %-8s %-5s %s\n' job gpu state rc seconds
  while read -r name gpu; do
    if [ -f "$STATE/rc/$name" ]; then
      read -r rc secs < "$STATE/rc/$name"
      printf '%-28s %-4s %-8s %-5s %s\n' "$name" "$gpu" ended "$rc" "$secs"
    elif [ -f "$STATE/run/$name" ]; then
      read -r _ rest < "$STATE/run/$name"
      printf '%-28s %-4s %-8s %-5s %s\n' "$name" "$gpu" running - "$(( $(date +%s) - rest ))"
      pending=1
    else
      printf '%-28s %-4s %-8s %-5s %s\n' "$name" "$gpu" queued - -
      pending=1
    fi
  done < "$STATE/jobs"
  return $pending
}

case "$cmd" in
  start)
    plan=${2:?usage: gpu_parallel.sh start PLAN [ONLY]}
    only=${3:-}
    [ -f "$plan" ] || { echo "no plan file $plan" >&2; exit 2; }
    ROOT=$(pwd)
    mkdir -p "$STATE"/{out,logs,rc,run,queues,locks}
    touch "$STATE/jobs"
    # parse first, start nothing if any line is malformed or names a job that exists already
    tmp=$(mktemp -d)
    n=0
    while read -r gpu name command; do
      case "$gpu" in ''|'#'*) continue ;; esac
      if [ -n "$only" ]; then
        keep=0
        IFS=, read -ra patterns <<< "$only"
        for pattern in "${patterns[@]}"; do
          # shellcheck disable=SC2053  # the pattern is a glob on purpose
          [[ "$gpu" == $pattern || "$name" == $pattern ]] && keep=1
        done
        [ "$keep" = 1 ] || continue
      fi
      if ! [[ "$gpu" =~ ^[0-9]+$ ]] || [ -z "$name" ] || [ -z "$command" ]; then
        echo "$plan: not 'GPU NAME COMMAND': $gpu $name $command" >&2; exit 2
      fi
      if grep -q "^$name " "$STATE/jobs" "$tmp/jobs" 2>/dev/null; then
        echo "$plan: job $name is already known in $STATE" >&2; exit 2
      fi
      printf '%s\t%s\n' "$name" "$command" >> "$tmp/gpu$gpu"
      echo "$name $gpu" >> "$tmp/jobs"
      n=$((n + 1))
    done < "$plan"
    [ "$n" -gt 0 ] || { echo "$plan: no jobs" >&2; exit 2; }
    cat "$tmp/jobs" >> "$STATE/jobs"
    export -f queue
    for f in "$tmp"/gpu*; do
      gpu=${f##*/gpu}
      q=$(mktemp "$STATE/queues/gpu$gpu.XXXX")
      cp "$f" "$q"
      STATE=$STATE ROOT=$ROOT setsid bash -c "queue $gpu $q" > /dev/null 2>&1 < /dev/null &
    done
    rm -rf "$tmp"
    echo "started $n jobs from $plan (state: $STATE)"
    ;;
  wait)
    secs=${2:?usage: gpu_parallel.sh wait SECONDS OUT}
    out=${3:?usage: gpu_parallel.sh wait SECONDS OUT}
    [ -f "$STATE/jobs" ] || { echo "nothing started (no $STATE/jobs)" >&2; exit 2; }
    end=$(( $(date +%s) + secs ))
    while ! table > /dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    table; all_ended=$?
    while read -r name _; do
      [ -f "$STATE/rc/$name" ] || continue
      read -r rc _ < "$STATE/rc/$name"
      [ "$rc" = 0 ] || { echo "--- $name (rc $rc), last lines:"; tail -n 15 "$STATE/logs/$name.log"; }
    done < "$STATE/jobs"
    mkdir -p "$out" "$STATE/pack"
    rm -rf "$STATE/pack"/*
    (cd "$STATE" && find out rc -type f -size -4M -print0 | xargs -0 -r cp --parents -t pack)
    mkdir -p "$STATE/pack/logs"
    for log in "$STATE"/logs/*.log; do [ -f "$log" ] && tail -n 400 "$log" > "$STATE/pack/logs/${log##*/}"; done
    tar czf "$out/parallel.tar.gz" -C "$STATE/pack" .
    exit $all_ended
    ;;
  status) table ;;
  *) echo "usage: gpu_parallel.sh start PLAN [ONLY] | wait SECONDS OUT | status" >&2; exit 2 ;;
esac
