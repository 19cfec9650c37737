#!/bin/bash
# Megatron-FSDP checks on one multi-GPU node (issue 22; docs/performance.md): on N GPUs
# (default 4), a 4-layer dense model trained 20 iterations under the distributed optimizer
# and under FSDP optim_grads, optim_grads_params and optim_grads_params with full
# recompute, and optim_grads_params with --init-model-with-meta-device (lm-loss parity, peak
# memory); a 6.7B llama under optim_grads_params with and without meta-device
# initialisation (peak memory, start-up); then llama-1.3B on one GPU plain, with the
# distributed optimizer and with FSDP (the cost at size 1). The scaling rows are
# bench/gpu_scaling.py's ("DP4 FSDP optim_grads" ...).
# Usage: MEGATON=build/megaton GPUS=4 OUT=/tmp/fsdp bash bench/fsdp_bench.sh
set -u
OUT=${OUT:-/tmp/fsdp_bench}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
M=${MEGATON:-build/megaton}
N=${GPUS:-4}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1 | tee $OUT/gpu.txt
L="mpirun --allow-run-as-root -np $N --bind-to none -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE"
A="--device cuda --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --num-layers 4 --hidden-size 1024 --num-attention-heads 8 --seq-length 1024 --micro-batch-size 2 --global-batch-size $((4 * N)) --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --lr 3e-4 --lr-warmup-iters 2 --train-iters 20 --log-interval 1 --eval-iters 0 --seed 1234"
for v in "distopt|--use-distributed-optimizer" "zero2|--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads" "zero3|--use-megatron-fsdp" "zero3-recompute|--use-megatron-fsdp --recompute-granularity full --recompute-method uniform --recompute-num-layers 1" "zero3-meta|--use-megatron-fsdp --init-model-with-meta-device"; do
  n=${v%%|*}; f=${v#*|}
  echo "=== $n $(date +%T)"; timeout 120 $L $M train $A $f --log-metrics-file $OUT/$n.jsonl > $OUT/$n.log 2>&1; echo rc=$?
  grep -E "iteration +20/" $OUT/$n.log | grep -oE "lm loss: [^|]*|peak memory \(MB\): [0-9.]+" | tr '\n' ' '; echo
done
python3 - $OUT <<'PY'
import json, sys
out = sys.argv[1]
def losses(n):
    try: return [json.loads(l)["lm_loss"] for l in open(f"{out}/{n}.jsonl")]
    except Exception: return []
ref = losses("distopt")
for n in ("zero2", "zero3", "zero3-recompute", "zero3-meta"):
    run = losses(n)
    if run and ref:
        d = max(abs(a - b) / abs(b) for a, b in zip(run, ref))
        print(f"{n} vs distributed optimizer: {len(run)} iterations, worst relative lm-loss difference {d:.2e}")
PY
B="--device cuda --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 31999 --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 --seq-length 2048 --micro-batch-size 1 --global-batch-size $N --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --train-iters 3 --log-interval 1 --eval-iters 0 --lr 1e-4 --lr-warmup-iters 1 --use-megatron-fsdp"
for v in "6.7b-zero3|" "6.7b-zero3-meta|--init-model-with-meta-device"; do
  n=${v%%|*}; f=${v#*|}
  s=$(date +%s); timeout 200 $L $M train $B $f > $OUT/$n.log 2>&1; rc=$?
  echo "$n rc=$rc, $(( $(date +%s) - s )) s: $(grep -E "iteration +3/" $OUT/$n.log | grep -oE "per iteration \(ms\): [0-9.]+|peak memory \(MB\): [0-9.]+" | tr '\n' ' ')"
done
echo "=== size 1 $(date +%T)"
python3 - $M <<'PY'
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath("bench/gpu_bench.py"))))
from gpu_bench import CONFIGS, run_megaton
c = CONFIGS["llama-1.3B"]
for name, extra in (("plain", []), ("distopt", ["--use-distributed-optimizer"]),
                    ("fsdp optim_grads_params", ["--use-megatron-fsdp"])):
    r = run_megaton(sys.argv[1], c, 20, extra=extra, micro_batches=2)
    print(f"size 1, llama-1.3B, {name}: {r}", flush=True)
PY
