#!/usr/bin/env bash
# Every implemented parallel layout reproduces the one-rank run: 3 training steps of a
# small MoE config on CPU ranks under mpirun, whose lm losses, grad norms and parameters
# after the steps (the saved checkpoint) match the one-rank run's to a relative
# difference of 1e-5 (tools/compare_runs.py).
# Usage: test_layouts_mpi.sh MEGATON MPIRUN NP_FLAG NP [MPIRUN FLAGS...]
# (CTest passes NP = 2; each layout below sets its own rank count.)
set -uo pipefail
megaton=$1 mpirun=$2 np_flag=$3
shift 4
mpi_flags=("$@")
here=$(cd "$(dirname "$0")" && pwd)
compare="$here/../../tools/compare_runs.py"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

config=(--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 127
  --num-layers 4 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2
  --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 1e-2
  --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
  --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0
  --make-vocab-size-divisible-by 64
  --seq-length 16 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3
  --lr-warmup-iters 1 --clip-grad 1.0 --eval-iters 0 --log-interval 1 --seed 1234)

run() {  # NAME NP FLAGS...
  local name=$1 np=$2
  shift 2
  mkdir -p "$dir/$name"
  local cmd=("$megaton" train "${config[@]}" --train-iters "${ITERS:-3}" "$@"
    --save "$dir/$name/save" --save-interval 3 --log-metrics-file "$dir/$name/metrics.jsonl")
  if [ "$np" -gt 1 ]; then cmd=("$mpirun" "$np_flag" "$np" "${mpi_flags[@]}" "${cmd[@]}"); fi
  OMP_NUM_THREADS=1 "${cmd[@]}" >"$dir/$name/out" 2>&1 || {
    echo "FAILED: $name exited with $?"; tail -5 "$dir/$name/out"; return 1; }
}

status=0
run one-rank 1 || exit 1
# name | ranks | flags
layouts=(
  "dp2|2|"
  "dp2-distributed-optimizer|2|--use-distributed-optimizer"
  "dp4-distributed-optimizer|4|--use-distributed-optimizer"
  # Expert parallelism: 4 experts, top-2. Expert gradients add the tokens of every rank of
  # the expert-model-parallel group.
  "ep2-alltoall|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
  "ep2-allgather|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"
  "dp2-ep2-alltoall|4|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
  "dp2-ep2-allgather|4|--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"
  "ep4-alltoall-distributed-optimizer|4|--expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall --use-distributed-optimizer"
  "dp2-ep2-distributed-optimizer|4|--expert-model-parallel-size 2 --use-distributed-optimizer"
  "ep2-etp2-alltoall|4|--expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --moe-token-dispatcher-type alltoall"
  "ep2-etp2-allgather|4|--expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --moe-token-dispatcher-type allgather"
)
# name | ranks, flags of the first two steps | ranks, flags of the third
resumes=(
  "dp2-distopt-to-one-rank|2|--use-distributed-optimizer|1|"
  "one-rank-to-dp4-distopt|1||4|--use-distributed-optimizer"
)
for entry in "${layouts[@]}"; do
  IFS='|' read -r name np flags <<<"$entry"
  # shellcheck disable=SC2086
  if run "$name" "$np" $flags; then
    if out=$(python3 "$compare" "$dir/one-rank" "$dir/$name"); then
      echo "ok: $name ($np ranks): $out"
    else
      echo "FAILED: $name ($np ranks) differs from one rank:"; echo "$out"; status=1
    fi
  else
    status=1
  fi
done
# A checkpoint written under one layout resumes under another: 2 steps on one layout,
# the third on another, against the one-rank run's third step and parameters.
resume() {  # NAME SRC_NP "SRC FLAGS" DST_NP "DST FLAGS"
  local name=$1
  # shellcheck disable=SC2086
  ITERS=2 run "$name-first" "$2" $3 || return 1
  # shellcheck disable=SC2086
  run "$name" "$4" --load "$dir/$name-first/save" $5 || return 1
  if out=$(python3 "$compare" --resumed "$dir/one-rank" "$dir/$name"); then
    echo "ok: resume $name: $out"
  else
    echo "FAILED: resume $name differs from one rank:"; echo "$out"; return 1
  fi
}
for entry in "${resumes[@]}"; do
  IFS='|' read -r name src_np src_flags dst_np dst_flags <<<"$entry"
  resume "$name" "$src_np" "$src_flags" "$dst_np" "$dst_flags" || status=1
done
exit $status
