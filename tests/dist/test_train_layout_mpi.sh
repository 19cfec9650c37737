#!/usr/bin/env bash
# `megaton train` under mpirun on 2 ranks rejects an impossible layout before building
# anything: every rank prints one error line naming the clashing numbers, the job exits
# with status 2, and no save directory is written.
# Usage: test_train_layout_mpi.sh MEGATON MPIRUN [MPIRUN FLAGS...] (the flags include -n 2)
set -uo pipefail
megaton=$1
shift
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
status=0
"$@" "$megaton" train --mock-data --tokenizer-type NullTokenizer --vocab-size 64 \
  --num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --train-iters 1 \
  --tensor-model-parallel-size 4 --save "$dir/save" >"$dir/out" 2>"$dir/err" || status=$?
expected="error: world size (2) is not divisible by tensor-model-parallel-size (4) x context-parallel-size (1) x pipeline-model-parallel-size (1) = 4"
fail() {
  echo "FAILED: $*"
  echo "--- stderr:"; cat "$dir/err"
  exit 1
}
[ "$status" -eq 2 ] || fail "exit status $status, expected 2"
for rank in 0 1; do
  [ "$(grep -cxF "[rank $rank] $expected" "$dir/err")" -eq 1 ] || fail "rank $rank's error line missing"
done
[ ! -e "$dir/save" ] || fail "the save directory was written"
echo "ok: both ranks rejected the layout with exit status 2"
