#!/bin/bash
# The GPU checks of issue 18 (memory): the GPU tests of the changed ops, recomputation's
# bitwise equality on the GPU under --deterministic-mode, and bench/gpu_bench.py's peak
# memory with default flags and with the lean options, Llama-3-8B included.
# Prepare here (the device tool's carry):
#   bash tools/gpu_bundle.sh gpu-bundle build/megaton build/test_train_gpu \
#     build/test_cuda_multi_tensor_gpu build/test_adam_control_gpu <other GPU tests>
#   cp ../shared/bench/torch_gpt.py gpu-bundle/
#   mkdir -p gpu-carry; tar -cJf gpu-carry/bundle.tar.xz gpu-bundle
# (carry gpu-carry and data/). Run there, from the repository root with $OUT set:
#   bash tools/gpu_memory_check.sh tests|recompute|bench|llama8b|fp16|offload
set -u
[ -d gpu-bundle ] || tar -xJf gpu-carry/bundle.tar.xz
export LD_LIBRARY_PATH=$PWD/gpu-bundle/lib NCCL_NVLS_ENABLE=0
B=gpu-bundle/bin
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
COMMON="train --device cuda --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 50303 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --eval-iters 0 --lr 1e-4 --lr-warmup-iters 1 --log-interval 1"
# Small versions of the dense and MoE benchmark configs (4 layers), with dropout so that
# the recomputed forwards must reproduce the masks.
DENSE="$COMMON --num-layers 4 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 5632 --seq-length 2048 --micro-batch-size 2 --global-batch-size 4 --hidden-dropout 0.1 --attention-dropout 0.1"
MOE="$COMMON --num-layers 4 --hidden-size 1536 --num-attention-heads 12 --seq-length 2048 --micro-batch-size 2 --global-batch-size 4 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 4096 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-shared-expert-intermediate-size 2048 --hidden-dropout 0.1 --attention-dropout 0"
LEAN_STATES="--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"
case "${1:-tests}" in
tests)
  for t in $(ls $B | grep '_gpu$'); do
    echo "== $t"; timeout 300 $B/$t > $OUT/$t.txt 2>&1; echo "rc=$?"
    grep -E "^\[  (PASSED|FAILED)|FAILED  \]" $OUT/$t.txt | head -8
  done
  ;;
recompute)
  # Each recompute choice against keeping everything: the logged lm loss, grad norm and
  # load-balancing loss of 6 steps must be bitwise equal (--deterministic-mode), with the
  # step time and peak memory of each.
  for model in DENSE MOE; do
    args=${!model}
    for choice in none "full_uniform_1:--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" \
        "full_block_2:--recompute-granularity full --recompute-method block --recompute-num-layers 2" \
        "selective_all:--recompute-granularity selective --recompute-modules core_attn layernorm mlp moe shared_experts" \
        "core_attn:--recompute-granularity selective" "mlp_layernorm:--recompute-granularity selective --recompute-modules mlp layernorm"; do
      name=${choice%%:*}; flags=""; [ "$name" = none ] || flags=${choice#*:}
      timeout 200 $B/megaton $args --train-iters 6 --deterministic-mode $flags \
        --log-metrics-file $OUT/metrics_${model}_$name.jsonl > $OUT/rc_${model}_$name.txt 2>&1
      echo "== $model $name rc=$? $(grep -oE 'per iteration \(ms\): [0-9.]+|peak memory \(MB\): [0-9.]+' $OUT/rc_${model}_$name.txt | tail -2 | paste -sd' ')"
      if [ "$name" != none ]; then
        cmp -s $OUT/metrics_${model}_none.jsonl $OUT/metrics_${model}_$name.jsonl &&
          echo "   bitwise equal to none" || { echo "   DIFFERS from none:"; diff $OUT/metrics_${model}_none.jsonl $OUT/metrics_${model}_$name.jsonl | head -4; }
      fi
    done
  done
  ;;
bench)  # the four benchmark configs: PyTorch, Megaton default, and the lean options
  python3 bench/gpu_bench.py --megaton $B/megaton --torch-script gpu-bundle/torch_gpt.py \
    --configs ${CONFIGS:-gpt2-124M,llama-1.3B,moe-8x-top2,moe-64x-top8} --iters 20 \
    --variant "selective+bf16-states=--recompute-granularity selective $LEAN_STATES" \
    --variant "mlp,layernorm+bf16-states=--recompute-granularity selective --recompute-modules mlp layernorm core_attn $LEAN_STATES" \
    --out $OUT/bench.md
  ;;
llama8b)  # the whole Llama-3-8B on one GPU (PyTorch's reference runs out of memory)
  python3 bench/gpu_bench.py --megaton $B/megaton --torch-script gpu-bundle/torch_gpt.py \
    --configs llama3-8B --iters 12 --no-default \
    --variant "bf16-states=$LEAN_STATES" \
    --variant "bf16-states+selective=--recompute-granularity selective $LEAN_STATES" \
    --variant "bf16-states+full=--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 $LEAN_STATES" \
    --out $OUT/llama8b.md
  ;;
fp16)  # --fp16 from Megatron's default scale 2^32 on the small configs: skips, then trains
  for model in DENSE MOE; do
    args=${!model}
    for prec in bf16 fp16; do
      flags=""; [ $prec = fp16 ] && flags="--fp16"
      a=${args/--bf16/}
      [ $prec = bf16 ] && a="$args"
      timeout 200 $B/megaton $a $flags --train-iters 40 --log-metrics-file $OUT/m_${model}_$prec.jsonl > $OUT/o_${model}_$prec.txt 2>&1
      echo "== $model $prec rc=$? $(grep -oE 'per iteration \(ms\): [0-9.]+|peak memory \(MB\): [0-9.]+' $OUT/o_${model}_$prec.txt | tail -2 | paste -sd' ')"
      python3 -c "import json,sys; m=[json.loads(l) for l in open(sys.argv[1])]; s=[r['iteration'] for r in m if r.get('skipped')]; print('   skipped', s, 'loss 1/20/40', [round(m[i]['lm_loss'],4) for i in (0,19,39)], 'scale', m[-1].get('loss_scale'))" $OUT/m_${model}_$prec.jsonl
    done
  done
  ;;
states)  # precision-aware states: bf16 main grads, fp16/fp8 moments (speed and peak, llama-1.3B and moe-8x)
  python3 bench/gpu_bench.py --megaton $B/megaton --torch-script gpu-bundle/torch_gpt.py --configs llama-1.3B,moe-8x-top2 --iters 12 --no-torch \
    --variant "bf16-grads=--use-precision-aware-optimizer --main-grads-dtype bf16" \
    --variant "fp16-moments=--use-precision-aware-optimizer --exp-avg-dtype fp16 --exp-avg-sq-dtype fp16" \
    --variant "fp8-fp16-moments=--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16" \
    --variant "fp16-main=--use-precision-aware-optimizer --main-params-dtype fp16" \
    --variant "lean=--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16" \
    --out $OUT/states.md
  cat $OUT/states.md
  ;;
logs)  # --log-energy and --tensorboard-dir on the GPU: the log line's energy, TensorBoard's own reader
  timeout 200 $B/megaton ${DENSE/--log-interval 1/--log-interval 4} --train-iters 12 --log-energy --tensorboard-dir $OUT/tb --log-timers-to-tensorboard --log-throughput > $OUT/logs.txt 2>&1
  echo "== logs rc=$?"; grep -oE "iteration +[0-9]+/.*(energy per GPU[^|]*\|[^|]*\|)" $OUT/logs.txt | grep -oE "iteration +[0-9]+|per iteration \(ms\): [0-9.]+|energy per GPU[^|]*\|[^|]*\|"
  python3 tools/tensorboard_scalars.py $OUT/tb > $OUT/tb.json && python3 -c "import json; d=json.load(open('$OUT/tb.json')); print(sorted(d)); print('power/gpu', d.get('power/gpu'))"
  ;;
offload)  # --optimizer-cpu-offload: speed and peak on llama-1.3B, and the curve against none
  python3 bench/gpu_bench.py --megaton $B/megaton --torch-script gpu-bundle/torch_gpt.py --configs llama-1.3B --iters 12 --no-torch \
    --variant "offload-0.5=--use-precision-aware-optimizer --optimizer-cpu-offload --optimizer-offload-fraction 0.5" \
    --variant "offload-1.0=--use-precision-aware-optimizer --optimizer-cpu-offload" \
    --out $OUT/offload.md
  for f in none "--use-precision-aware-optimizer --optimizer-cpu-offload --optimizer-offload-fraction 0.5"; do
    n=$([ "$f" = none ] && echo none || echo half)
    [ "$f" = none ] && f=""
    timeout 200 $B/megaton $DENSE --train-iters 20 $f --log-metrics-file $OUT/off_$n.jsonl > $OUT/off_$n.txt 2>&1; echo "== offload $n rc=$?"
  done
  python3 -c "import json; a=[json.loads(l) for l in open('$OUT/off_none.jsonl')]; b=[json.loads(l) for l in open('$OUT/off_half.jsonl')]; print('   max relative loss difference over 20 steps', max(abs(x['lm_loss']-y['lm_loss'])/x['lm_loss'] for x,y in zip(a,b)))"
  ;;
esac
