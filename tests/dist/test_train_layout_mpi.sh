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
fail() {
  echo "FAILED: $*"
  echo "--- stderr:"; cat "$dir/err"
  exit 1
}
rejects() {  # EXPECTED FLAGS...
  local expected=$1 status=0
  shift
  rm -rf "$dir/save"
  "${launcher[@]}" "$megaton" train --mock-data --tokenizer-type NullTokenizer --vocab-size 64 \
    --num-layers 4 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --train-iters 1 \
    "$@" --save "$dir/save" >"$dir/out" 2>"$dir/err" || status=$?
  [ "$status" -eq 2 ] || fail "exit status $status, expected 2"
  for rank in 0 1; do
    [ "$(grep -cxF "[rank $rank] error: $expected" "$dir/err")" -eq 1 ] ||
      fail "rank $rank's error line missing"
  done
  [ ! -e "$dir/save" ] || fail "the save directory was written"
}
launcher=("$@")
rejects "world size (2) is not divisible by tensor-model-parallel-size (4) x context-parallel-size (1) x pipeline-model-parallel-size (1) = 4" \
  --tensor-model-parallel-size 4
# The interleaved schedule needs micro-batch groups of pp: 3 micro-batches on pp 2.
rejects "the interleaved pipeline schedule (num-layers-per-virtual-pipeline-stage) needs the micro-batches per step, global-batch-size / (micro-batch-size x data-parallel size) = 3, to be a multiple of pipeline-model-parallel-size (2)" \
  --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 \
  --micro-batch-size 1 --global-batch-size 3
echo "ok: both ranks rejected each layout with exit status 2"
