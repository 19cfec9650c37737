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
  --seq-length 16 --micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3
  --lr-warmup-iters 1 --clip-grad 1.0 --eval-iters 0 --log-interval 1 --seed 1234)

run() {  # NAME NP FLAGS...
  local name=$1 np=$2
  shift 2
  mkdir -p "$dir/$name"
  local cmd=("$megaton" train "${config[@]}" "$@" --save "$dir/$name/save" --save-interval 3
    --log-metrics-file "$dir/$name/metrics.jsonl")
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
exit $status
