#!/bin/bash
# The GPU checks of issue 17's step work: the GPU tests of the changed ops and layers, op
# profiles of the step before and after (an older binary carried as gpu-bundle/bin/megaton-old),
# the grouped GEMM alone, and bench/gpu_bench.py.
# Prepare here (the device tool's carry):
#   bash tools/gpu_bundle.sh gpu-bundle build/megaton build/test_cuda_pointwise_gpu \
#     build/test_train_gpu build/test_fp8_linear_gpu build/test_fp8_moe_gpu \
#     build/test_cuda_moe_gpu build/bench_grouped_gemm_gpu build/test_host_sync_gpu
#   cp <old megaton> gpu-bundle/bin/megaton-old; cp ../shared/bench/torch_gpt.py gpu-bundle/
#   mkdir -p gpu-carry; tar -cJf gpu-carry/bundle.tar.xz gpu-bundle
# (carry gpu-carry and data/, which test_train_gpu reads). Run there, from the repository
# root with $OUT set:
#   bash tools/gpu_step_check.sh nosync|qknorm|graph|tests|dense|moe|extra|fp8
# (BENCH_FLAGS, e.g. --cuda-graph, is passed to bench/gpu_bench.py.)
set -u
[ -d gpu-bundle ] || tar -xJf gpu-carry/bundle.tar.xz
export LD_LIBRARY_PATH=$PWD/gpu-bundle/lib NCCL_NVLS_ENABLE=0
B=gpu-bundle/bin
nvidia-smi --query-gpu=name --format=csv,noheader
LLAMA="train --device cuda --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 50303 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 5632 --seq-length 2048 --micro-batch-size 4 --global-batch-size 4 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --train-iters 12 --log-interval 4 --eval-iters 0 --lr 1e-4 --lr-warmup-iters 1"
MOE="train --device cuda --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 50303 --num-layers 12 --hidden-size 1536 --num-attention-heads 12 --seq-length 2048 --micro-batch-size 4 --global-batch-size 4 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --train-iters 12 --log-interval 4 --eval-iters 0 --lr 1e-4 --lr-warmup-iters 1 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 4096 --moe-aux-loss-coeff 1e-2"
profile() {  # name binary args...
  local name=$1 bin=$2; shift 2
  MEGATON_OP_PROFILE=1 timeout 90 $bin "$@" > $OUT/prof_$name.txt 2>&1
  echo "== $name rc=$?"; grep -E "iteration +12" $OUT/prof_$name.txt | head -1
  sed -n '/op profile/,$p' $OUT/prof_$name.txt | head -22
  grep "host synchronizations" $OUT/prof_$name.txt
}
GPT2="train --device cuda --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 50303 --num-layers 12 --hidden-size 768 --num-attention-heads 12 --ffn-hidden-size 2048 --seq-length 1024 --micro-batch-size 16 --global-batch-size 16 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --train-iters 12 --log-interval 4 --eval-iters 0 --lr 1e-4 --lr-warmup-iters 1"
case "${1:-tests}" in
bda)  # issue 17, third session: the fused bias-dropout-add and the GEMM bias epilogue
  # (gpu-bundle/bin/megaton-old: before both; megaton-bda: with the first only)
  for t in test_cuda_bias_dropout_add_gpu test_cuda_gemm_bias_gpu test_cuda_gemm_gpu test_kv_cache_gpu \
      test_cuda_pointwise_gpu test_cuda_graph_train_gpu test_train_gpu; do
    echo "== $t"; timeout 240 $B/$t > $OUT/$t.txt 2>&1; echo "rc=$?"
    grep -E "^\[  (PASSED|FAILED)|FAILED  \]|graph nodes" $OUT/$t.txt | head -8
  done
  for t in test_cuda_bias_dropout_add_gpu test_cuda_gemm_bias_gpu; do
    timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck $B/$t > $OUT/sanitizer_$t.txt 2>&1
    echo "sanitizer $t rc=$?"; tail -1 $OUT/sanitizer_$t.txt
  done
  # GPT-2 as Megatron trains it: LayerNorm, GeLU, biases, learned positions, hidden dropout.
  GPT2B="train --device cuda --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 50303 --num-layers 12 --hidden-size 768 --num-attention-heads 12 --ffn-hidden-size 3072 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 16 --global-batch-size 16 --normalization LayerNorm --hidden-dropout 0.1 --attention-dropout 0 --train-iters 24 --log-interval 4 --eval-iters 0 --lr 1e-4 --lr-warmup-iters 1"
  for rep in 1 2; do
    for bin in megaton-old megaton-bda megaton; do  # the binaries present in gpu-bundle/bin
      [ -x $B/$bin ] || continue
      timeout 150 $B/$bin $GPT2B > $OUT/gpt2b_${bin}_$rep.txt 2>&1
      echo "== gpt2 biases+dropout $bin run $rep rc=$?"
      grep -oE "iteration +[0-9]+/ +24 .{0,60}elapsed time per iteration \(ms\): [0-9.]+|lm loss: [0-9.E+-]+" $OUT/gpt2b_${bin}_$rep.txt | tail -6 | paste - -
    done
  done
  MEGATON_OP_PROFILE=1 timeout 150 $B/megaton ${GPT2B/--train-iters 24/--train-iters 12} > $OUT/prof_gpt2b.txt 2>&1
  sed -n '/op profile/,$p' $OUT/prof_gpt2b.txt | head -24
  ;;
graph)  # issue 17, third session: --cuda-graph-impl full_iteration
  for t in test_cuda_graph_gpu test_cuda_graph_train_gpu test_adam_control_gpu test_host_sync_gpu \
      test_cuda_multi_tensor_gpu test_train_gpu; do
    echo "== $t"; timeout 240 $B/$t > $OUT/$t.txt 2>&1; echo "rc=$?"
    grep -E "^\[  (PASSED|FAILED)|FAILED  \]|host synchronizations|graph nodes" $OUT/$t.txt | head -8
  done
  timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck $B/test_cuda_graph_gpu \
    > $OUT/sanitizer_graph.txt 2>&1
  echo "sanitizer graph rc=$?"; tail -2 $OUT/sanitizer_graph.txt
  for cfg in GPT2 LLAMA MOE; do
    for g in "" "--cuda-graph-impl full_iteration"; do
      name=${cfg}${g:+_graph}
      timeout 150 $B/megaton ${!cfg/--train-iters 12/--train-iters 24} $g > $OUT/run_$name.txt 2>&1
      echo "== $name rc=$?"; grep -E "cuda graph:" $OUT/run_$name.txt
      grep -oE "iteration +[0-9]+/ +24 .{0,60}elapsed time per iteration \(ms\): [0-9.]+|peak memory \(MB\): [0-9.]+" $OUT/run_$name.txt | tail -4
    done
  done
  ;;
nosync)  # issue 17, second session: device-counted grouped GEMMs, the device-decided step
  for t in test_host_sync_gpu "test_cuda_gemm_gpu --gtest_filter=CudaGroupedGemm*" \
      test_adam_control_gpu test_cuda_multi_tensor_gpu test_cuda_reduce_gpu test_cuda_moe_gpu \
      test_cuda_moe_router_gpu test_fp8_moe_gpu test_train_gpu; do
    name=${t%% *}
    echo "== $t"; timeout 240 $B/$t > $OUT/$name.txt 2>&1; echo "rc=$?"
    grep -E "^\[  (PASSED|FAILED)|FAILED  \]|host synchronizations:" $OUT/$name.txt | head -8
  done
  timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck $B/test_cuda_gemm_gpu \
    --gtest_filter='CudaGroupedGemmDeviceCounts*' > $OUT/sanitizer_gemm.txt 2>&1
  echo "sanitizer gemm rc=$?"; tail -2 $OUT/sanitizer_gemm.txt
  timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck $B/test_adam_control_gpu \
    > $OUT/sanitizer_adam.txt 2>&1
  echo "sanitizer adam rc=$?"; tail -2 $OUT/sanitizer_adam.txt
  timeout 60 $B/bench_grouped_gemm_gpu > $OUT/grouped.txt 2>&1; tail -24 $OUT/grouped.txt
  profile moe_new $B/megaton $MOE
  profile llama_new $B/megaton $LLAMA
  ;;
qknorm)  # the fused QK layernorm, the uploads, the MoE device counts in the layer
  for t in test_host_sync_gpu test_moe_device_counts_gpu test_cuda_qkv_norm_gpu test_kv_cache_gpu \
      test_adam_control_gpu test_train_gpu; do
    echo "== $t"; timeout 240 $B/$t > $OUT/$t.txt 2>&1; echo "rc=$?"
    grep -E "^\[  (PASSED|FAILED)|FAILED  \]|host synchronizations:" $OUT/$t.txt | head -8
  done
  for t in "test_cuda_qkv_norm_gpu --gtest_filter=*np16_ng8_d128*:*d72*:*Deterministic*" \
      test_moe_device_counts_gpu; do
    name=${t%% *}
    timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck $B/$t > $OUT/sanitizer_$name.txt 2>&1
    echo "sanitizer $name rc=$?"; tail -1 $OUT/sanitizer_$name.txt
  done
  for qk in "" "--qk-layernorm"; do
    echo "== llama $qk"
    timeout 120 $B/megaton ${LLAMA/--train-iters 12/--train-iters 20} $qk > $OUT/llama${qk:+_qk}.txt 2>&1
    echo "rc=$?"; grep -oE "iteration +[0-9]+/ +20 .{0,60}elapsed time per iteration \(ms\): [0-9.]+" $OUT/llama${qk:+_qk}.txt | tail -3
  done
  profile llama_qk $B/megaton $LLAMA --qk-layernorm
  ;;
tests)
  for t in test_host_sync_gpu test_cuda_pointwise_gpu test_train_gpu test_fp8_linear_gpu test_fp8_moe_gpu test_cuda_moe_gpu; do
    echo "== $t"; timeout 200 $B/$t > $OUT/$t.txt 2>&1; echo "rc=$?"
    grep -E "^\[  (PASSED|FAILED)|FAILED  \]" $OUT/$t.txt | head -8
  done
  timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck $B/test_cuda_pointwise_gpu \
    --gtest_filter='*Fused*:*Swiglu*:*Gelu*' > $OUT/sanitizer.txt 2>&1
  echo "sanitizer rc=$?"; tail -2 $OUT/sanitizer.txt
  $B/bench_grouped_gemm_gpu > $OUT/grouped.txt 2>&1; tail -14 $OUT/grouped.txt
  profile llama_old $B/megaton-old $LLAMA
  profile llama_new $B/megaton $LLAMA
  ;;
dense)
  timeout 560 python3 bench/gpu_bench.py --megaton $B/megaton --torch-script gpu-bundle/torch_gpt.py \
    --configs gpt2-124M,llama-1.3B --iters 20 ${BENCH_FLAGS:-} > $OUT/bench_dense.txt 2>&1
  tail -12 $OUT/bench_dense.txt
  ;;
moe)
  profile moe_old $B/megaton-old $MOE
  profile moe_new $B/megaton $MOE
  timeout 420 python3 bench/gpu_bench.py --megaton $B/megaton \
    --torch-script gpu-bundle/torch_gpt.py --configs moe-8x-top2,moe-64x-top8 --iters 20 ${BENCH_FLAGS:-} > $OUT/bench_moe.txt 2>&1
  tail -12 $OUT/bench_moe.txt
  ;;
extra)  # the grouped GEMM, gpt2-124M's profile, and the cost of --deterministic-mode
  $B/bench_grouped_gemm_gpu > $OUT/grouped.txt 2>&1; tail -14 $OUT/grouped.txt
  profile gpt2 $B/megaton $GPT2
  profile moe_pingpong $B/megaton $MOE
  for cfg in LLAMA MOE; do
    for det in "" "--deterministic-mode"; do
      echo "== $cfg $det"
      timeout 150 $B/megaton ${!cfg/--train-iters 12/--train-iters 20} $det > $OUT/det_${cfg}${det:+_det}.txt 2>&1
      echo "rc=$?"; grep -oE "iteration +[0-9]+/ +20 .{0,60}elapsed time per iteration \(ms\): [0-9.]+" $OUT/det_${cfg}${det:+_det}.txt | tail -3
    done
  done
  ;;
fp8)  # FP8 rows (torchao carried as a wheel in gpu-carry/)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site gpu-carry/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site
  timeout 560 python3 bench/gpu_bench.py --megaton $B/megaton --torch-script gpu-bundle/torch_gpt.py \
    --configs ${CONFIGS:-llama-1.3B,moe-8x-top2} --iters 20 --fp8 tensorwise ${BENCH_FLAGS:-} > $OUT/bench_fp8.txt 2>&1
  tail -12 $OUT/bench_fp8.txt
  ;;
esac
