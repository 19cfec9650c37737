#!/bin/bash
# Context parallelism benchmark (issue 22; docs/performance.md): a 4-layer dense model on
# one GPU, as CP2 (a2a) and as DP2 on two GPUs, bf16: ms per iteration, peak memory, and the
# lm-loss difference to one GPU. Usage: MEGATON=build/megaton S=32768 GBS=2 OUT=/tmp/cp bash bench/cp_bench.sh
set -u
OUT=${OUT:-/tmp/cp_bench}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
M=${MEGATON:-build/megaton}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
L="mpirun --allow-run-as-root -np 2 --bind-to none -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE"
A="--device cuda --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --num-layers 4 --hidden-size 1024 --num-attention-heads 8 --seq-length ${S:-4096} --micro-batch-size 1 --global-batch-size ${GBS:-4} --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --lr 3e-4 --lr-warmup-iters 2 --train-iters 20 --log-interval 1 --eval-iters 0 --seed 1234"
echo "=== one GPU $(date +%T)"; timeout 150 $M train $A --log-metrics-file $OUT/one.jsonl > $OUT/one.log 2>&1; echo rc=$?
echo "=== CP2 a2a $(date +%T)"; timeout 150 $L $M train $A --context-parallel-size 2 --cp-comm-type a2a --log-metrics-file $OUT/cp2.jsonl > $OUT/cp2.log 2>&1; echo rc=$?
echo "=== DP2 $(date +%T)"; timeout 150 $L $M train $A --log-metrics-file $OUT/dp2.jsonl > $OUT/dp2.log 2>&1; echo rc=$?
echo "=== CP2 p2p on cuda (refused) $(date +%T)"; timeout 60 $L $M train $A --context-parallel-size 2 > $OUT/p2p.log 2>&1; echo rc=$?; grep -m1 "error" $OUT/p2p.log
for f in one cp2 dp2; do grep -E "iteration +(1|10|20)/" $OUT/$f.log | sed 's/| throughput.*lm loss/| lm loss/' | cut -c1-170; grep -iE "error|nan" $OUT/$f.log | head -3; done
python3 - $OUT <<'PY'
import json, sys
out = sys.argv[1]
def losses(n):
    try: return [json.loads(l)["lm_loss"] for l in open(f"{out}/{n}.jsonl")]
    except Exception as e: return []
one, cp2, dp2 = losses("one"), losses("cp2"), losses("dp2")
for name, run in (("cp2", cp2), ("dp2", dp2)):
    if run and one:
        d = max(abs(a - b) / abs(b) for a, b in zip(run, one))
        print(f"{name} vs one GPU: {len(run)} iterations, worst relative lm-loss difference {d:.2e}; last {run[-1]:.5f} vs {one[-1]:.5f}")
PY
