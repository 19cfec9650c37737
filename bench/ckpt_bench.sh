#!/bin/bash
# Checkpoint save / load benchmark (issue 21; a table in docs/performance.md, not a test):
# moe-64x-top8 (bench/gpu_bench.py's config, micro-batch 1) on N GPUs of one host with
# EP = N and the distributed optimizer: --async-save's stall and background write time,
# a blocking save's stall, each rank file's bytes, and the load time, from the log lines.
# Usage: MEGATON=build/megaton RANKS="4 2 1" OUT=/tmp/ckpt_bench SAVE_ROOT=/tmp bash bench/ckpt_bench.sh
set -u
M=${MEGATON:-build/megaton}
OUT=${OUT:-/tmp/ckpt_bench}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; df -h "${SAVE_ROOT:-/tmp}" | tail -1
A="--device cuda --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --num-layers 8
 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 1 --swiglu
 --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
 --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 0
 --lr 1e-4 --lr-warmup-iters 1 --num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 1024
 --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall --use-distributed-optimizer"
for N in ${RANKS:-4 2 1}; do
  L="mpirun --allow-run-as-root -np $N --bind-to none -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE"
  B="$A --expert-model-parallel-size $N --global-batch-size $((4 * N))"
  D=${SAVE_ROOT:-/tmp}/ckpt_bench_$N; rm -rf "$D" "$D-async"
  echo "=== $N ranks: async save"
  timeout "${T:-300}" $L "$M" train $B --train-iters 4 --save "$D-async" --save-interval 2 --async-save >"$OUT/async$N.log" 2>&1
  grep -E "iteration +[1-4]/|stalled|background" "$OUT/async$N.log" | sed 's/| throughput.*//' | cut -c1-200
  rm -rf "$D-async"
  echo "=== $N ranks: blocking save"
  timeout "${T:-300}" $L "$M" train $B --train-iters 2 --save "$D" --save-interval 2 >"$OUT/save$N.log" 2>&1
  grep -E "stalled" "$OUT/save$N.log"
  du -sb "$D"/iter_0000002/*
  echo "=== $N ranks: load"
  timeout "${T:-300}" $L "$M" train $B --train-iters 3 --load "$D" >"$OUT/load$N.log" 2>&1
  grep -E "loaded" "$OUT/load$N.log"
  rm -rf "$D"
done
