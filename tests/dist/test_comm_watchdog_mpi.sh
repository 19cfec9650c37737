#!/usr/bin/env bash
# The communication watchdog: a rank stalled mid-training (SIGSTOP) leaves the other rank in
# a collective; with MEGATON_COMM_TIMEOUT_S=5 that rank ends within the deadline (plus
# startup slack) with one line naming the collective, the group and its ranks, the call
# site and the iteration, and the job ends (mpirun takes down the stalled rank): no rank
# waits forever.
# Usage: test_comm_watchdog_mpi.sh MEGATON MPIRUN NP_FLAG NP [MPIRUN FLAGS...]
set -uo pipefail
megaton=$1 mpirun=$2 np_flag=$3
shift 4
mpi_flags=("$@")
dir=$(mktemp -d)
stalled=""
cleanup() {
  [ -n "$stalled" ] && kill -9 "$stalled" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAILED: $*"
  tail -5 "$dir/out" "$dir/err" 2>/dev/null
  exit 1
}
export OMP_NUM_THREADS=1 MEGATON_COMM_TIMEOUT_S=5
"$mpirun" "$np_flag" 2 "${mpi_flags[@]}" -x MEGATON_COMM_TIMEOUT_S -x OMP_NUM_THREADS \
  "$megaton" train --device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 63 \
  --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 \
  --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 1000000 --eval-iters 0 \
  --log-interval 1 --log-metrics-file "$dir/metrics.jsonl" >"$dir/out" 2>"$dir/err" &
job=$!
for _ in $(seq 1 600); do
  grep -qE "iteration +3/" "$dir/out" 2>/dev/null && break
  sleep 0.1
done
grep -qE "iteration +3/" "$dir/out" || fail "the run did not reach iteration 3"
for p in $(pgrep -f "$dir/metrics.jsonl"); do
  if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1"; then
    stalled=$p
  fi
done
[ -n "$stalled" ] || fail "rank 1's process not found"
kill -STOP "$stalled"
start=$SECONDS
wait "$job"
status=$?
elapsed=$((SECONDS - start))
echo "job ended $elapsed s after rank 1 stopped, exit status $status"
[ "$status" -ne 0 ] || fail "the job exited 0"
[ "$elapsed" -le 30 ] || fail "the job took $elapsed s to end (deadline 5 s)"
line=$(grep -m1 "timed out after 5 s" "$dir/err") || fail "no timeout line"
echo "$line"
echo "$line" | grep -qE "^(\[rank 0\] )?communication error: [a-z_]+ on group [a-z_]+ \(ranks 0,1\) timed out after 5 s at world rank 0, called from src/[a-z_/]+\.(cpp|cu|h):[0-9]+ in iteration [0-9]+$" ||
  fail "the line does not name the collective, group, ranks, call site and iteration"
echo PASSED
