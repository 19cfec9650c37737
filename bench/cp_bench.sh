#!/bin/bash
# Context parallelism benchmark (issue 22; docs/performance.md): one GPU against CP2 (each
# --cp-comm-type) and DP2 on two GPUs of one host, bf16, mock data, micro-batch 1: ms per
# iteration (median of iterations 3..N-1), peak memory, and the worst lm-loss difference
# to one GPU.
# Usage: MEGATON=build/megaton MODEL=small|llama-1.3B S=32768 GBS=2 ITERS=12 \
#          TYPES="p2p all_gather a2a" OUT=/tmp/cp bash bench/cp_bench.sh
set -u
OUT=${OUT:-/tmp/cp_bench}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
M=${MEGATON:-build/megaton}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
L="mpirun --allow-run-as-root -np 2 --bind-to none -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE"
case ${MODEL:-small} in
  small) SHAPE="--num-layers 4 --hidden-size 1024 --num-attention-heads 8" ;;
  # bench/gpu_bench.py's llama-1.3B
  llama-1.3B) SHAPE="--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 5632" ;;
  *) echo "unknown MODEL ${MODEL}"; exit 2 ;;
esac
A="--device cuda --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 $SHAPE --seq-length ${S:-4096} --micro-batch-size 1 --global-batch-size ${GBS:-4} --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --lr 3e-4 --lr-warmup-iters 2 --train-iters ${ITERS:-12} --log-interval 1 --eval-iters 0 --seed 1234"
T=${TIMEOUT:-200}
echo "=== one GPU $(date +%T)"; timeout $T $M train $A --log-metrics-file $OUT/one.jsonl > $OUT/one.log 2>&1; echo rc=$?
runs="one"
for type in ${TYPES:-p2p all_gather a2a}; do
  echo "=== CP2 $type $(date +%T)"
  timeout $T $L $M train $A --context-parallel-size 2 --cp-comm-type $type --log-metrics-file $OUT/cp2-$type.jsonl > $OUT/cp2-$type.log 2>&1; echo rc=$?
  runs="$runs cp2-$type"
done
echo "=== DP2 $(date +%T)"; timeout $T $L $M train $A --log-metrics-file $OUT/dp2.jsonl > $OUT/dp2.log 2>&1; echo rc=$?
runs="$runs dp2"
python3 - $OUT $runs <<'PY'
import json, re, statistics, sys
out, runs = sys.argv[1], sys.argv[2:]
def losses(n):
    try: return [json.loads(l)["lm_loss"] for l in open(f"{out}/{n}.jsonl")]
    except Exception: return []
one = losses("one")
for n in runs:
    text = open(f"{out}/{n}.log", errors="replace").read()
    ms = [float(x) for x in re.findall(r"per iteration \(ms\): ([\d.]+)", text)]
    mem = re.findall(r"peak memory \(MB\): ([\d.]+)", text)
    run = losses(n)
    d = max((abs(a - b) / abs(b) for a, b in zip(run, one)), default=float("nan"))
    step = statistics.median(ms[2:-1]) if len(ms) > 3 else float("nan")
    err = [l for l in text.splitlines() if "error" in l.lower()][:2]
    print(f"{n:16s} {step:9.1f} ms/iter  peak {mem[-1] if mem else '-':>8s} MB  "
          f"{len(run)} iterations, worst lm-loss difference to one GPU {d:.2e} {err}")
PY
