#!/bin/bash
# The GPU checks of the FP8 MoE experts (issue 16): the FP8 GPU tests, an op profile of
# moe-8x-top2 in FP8 tensorwise, and bench/gpu_bench.py's moe-8x-top2 FP8 rows.
# Prepare here (the device tool's carry): bash tools/gpu_bundle.sh gpu-bundle build/megaton
#   build/test_cuda_fp8_gpu build/test_cuda_fp8_multi_gpu build/test_cuda_fp8_grouped_gpu
#   build/test_fp8_linear_gpu build/test_fp8_moe_gpu build/test_cuda_moe_gpu;
#   cp ../shared/bench/torch_gpt.py gpu-bundle/; mkdir -p gpu-carry;
#   tar -cJf gpu-carry/bundle.tar.xz gpu-bundle; cp <torchao wheel> gpu-carry/
# Run there, from the repository root with $OUT set: bash tools/gpu_fp8_moe_check.sh
tar -xJf gpu-carry/bundle.tar.xz
export LD_LIBRARY_PATH=$PWD/gpu-bundle/lib NCCL_NVLS_ENABLE=0
B=gpu-bundle/bin
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site gpu-carry/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
for t in test_cuda_fp8_gpu test_cuda_fp8_multi_gpu test_cuda_fp8_grouped_gpu test_fp8_linear_gpu test_fp8_moe_gpu test_cuda_moe_gpu; do
  echo "== $t"; timeout 120 $B/$t > $OUT/$t.txt 2>&1; echo "rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" $OUT/$t.txt | head -5
done
ARGS="train --device cuda --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 50303 --num-layers 12 --hidden-size 1536 --num-attention-heads 12 --seq-length 2048 --micro-batch-size 4 --global-batch-size 4 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --train-iters 8 --log-interval 4 --eval-iters 0 --lr 1e-4 --lr-warmup-iters 1 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 4096 --moe-aux-loss-coeff 1e-2"
MEGATON_OP_PROFILE=1 timeout 60 $B/megaton $ARGS --fp8-format hybrid --fp8-recipe tensorwise > $OUT/prof_fp8.txt 2>&1
sed -n '/op profile/,$p' $OUT/prof_fp8.txt | head -16
timeout 330 python3 bench/gpu_bench.py --megaton $B/megaton --torch-script gpu-bundle/torch_gpt.py --configs moe-8x-top2 --iters 20 --fp8 tensorwise,delayed,blockwise > $OUT/bench.txt 2>&1
tail -8 $OUT/bench.txt
