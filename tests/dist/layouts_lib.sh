# The machinery of the layout tests (test_layouts_mpi.sh, test_muon_layouts_mpi.sh), sourced
# by them: the small MoE config, its model variants, `run` (one training run under mpirun,
# its metrics and checkpoint in $dir/NAME) and `reference_of` (the one-rank run of a
# variant), then `compare_layouts` and `compare_resumes` over the caller's `layouts` and
# `resumes` arrays. The caller sets: megaton mpirun np_flag mpi_flags (its arguments).
compare="$here/../../tools/compare_runs.py"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

config=(--device cpu --mock-data --tokenizer-type NullTokenizer
  --hidden-size 32 --num-attention-heads 4 --num-query-groups 2
  --num-experts 4 --moe-router-topk 2
  --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
  --hidden-dropout 0 --attention-dropout 0
  --seq-length 16 --global-batch-size 8 --lr 1e-3
  --lr-warmup-iters 1 --clip-grad 1.0 --log-params-norm --log-num-zeros-in-grad --eval-iters 0 --log-interval 1 --seed 1234)

# Router variants (issue 5): Megatron's routing and load-balancing options.
router_flags() {  # NAME
  case $1 in
    "") echo "--moe-aux-loss-coeff 1e-2" ;;  # aux_loss, Megatron's default type
    seqaux) echo "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-2" ;;
    global) echo "--moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3" ;;
    bias) echo "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-2 --moe-router-load-balancing-type none --moe-aux-loss-coeff 0" ;;
    v3) echo "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 2 --moe-router-group-topk 1 --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3 --moe-shared-expert-intermediate-size 32" ;;
    # Token dropping: capacity ceil(32 x 2 / 4 x cf) = 8 (half the copies dropped) or 16
    # (about 8% dropped) of about 16 copies per expert and micro-batch.
    capacity) echo "--moe-aux-loss-coeff 1e-2 --moe-expert-capacity-factor 0.5" ;;
    capacity-pad) echo "--moe-aux-loss-coeff 1e-2 --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --moe-token-drop-policy position" ;;
    gate) echo "--moe-aux-loss-coeff 1e-2 --moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate" ;;  # Qwen2-MoE style
    *) echo "FAILED: unknown router variant '$1'" >&2; exit 1 ;;
  esac
}

# The model variant of the next runs: 4 layers and untied embeddings unless a layout's
# variant says "LAYERS=n" and/or "TIED=1"; "ROUTER=name" adds router flags (above);
# "QKN=1" adds --qk-layernorm; "A2A=x" runs with MEGATON_MOE_ALLTOALL_EXCHANGE=x;
# "MBS=n" sets the micro-batch size (the one-rank run of a DP layout whose global
# micro-batches must be the reference's micro-batches: global_aux_loss); "VOCAB=n" the
# NullTokenizer's vocabulary (n tokens + eod) and "PAD=n" --make-vocab-size-divisible-by
# (default 127 + eod padded by 64: 128 rows under TP 1 and 2 alike); "FP8=recipe" trains
# the layers' linear GEMMs and the experts' in FP8 (hybrid format), with --kv-channels 16
# and --moe-ffn-hidden-size 64 so that every FP8 GEMM dimension of a TP2 / ETP2 rank is a
# multiple of 16; "MFFN=n" sets --moe-ffn-hidden-size otherwise; "RTOL=x" compares with
# tools/compare_runs.py --rtol x (default 1e-5); "PAO=1" keeps Adam's moments in bf16
# (--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16), "PAO=fp16"
# and "PAO=fp8" in fp16 or fp8 with per-parameter scales (both moments);
# "RC=full|block|sel" recomputes activations: whole layers in groups of 2 (uniform), the
# first layer of each model chunk (block), or every selective module; "FP16=1" scales the
# loss as --fp16 does (dynamic, from 1024, doubling every 2 clean steps; the CPU computes
# fp32, so the scaled gradients and their unscaling are what differs from one rank);
# "OFF=1" offloads half of the optimizer's elements to host buffers (--optimizer-cpu-offload
# --optimizer-offload-fraction 0.5, with the precision-aware optimizer it needs);
# "MG=bf16" keeps the main grads in bf16 grad buffers (--bf16 --use-precision-aware-optimizer
# --main-grads-dtype bf16; the CPU computes fp32 and rounds each accumulation into them),
# "MG=reduce" the same through --bf16 --grad-reduce-in-bf16; "ZATOL=n" compares the zero
# counts within n elements (tools/compare_runs.py --num-zeros-atol; default exact).
# "EOD=1" leaves the predictions at eod input tokens out of the loss (--eod-mask-loss).
# "PTL=1" divides the gradients by the step's loss tokens (--calculate-per-token-loss).
# "BS=ramp" ramps the global batch size from 4 to 8 after 8 samples (--rampup-batch-size
# 4 4 8: batches 4, 4, 8), "BS=step" steps it at 128 tokens (--step-batch-size-schedule
# "0:4 128:8", thresholds in tokens of 16: the same batches); the schedule and the
# learning rate follow the consumed samples, which compare_runs.py checks exactly.
# "MLA=1" replaces self attention with multi-latent attention (issue 20): q LoRA, the latent
# norms, YaRN (factor 4 over 4 positions, mscale 1 and mscale_all_dim 0.707), value heads of
# 4 beside query/key heads of 8 + 8; with "RC=sel" the mla_up_proj recompute joins.
# "MTP=n" adds n multi-token prediction depths (--mtp-num-layers n, loss scale 0.3); their
# mtp_k losses are compared too.
# "PACK=1" packs documents (--reset-position-ids --reset-attention-mask): positions restart
# after each eod and the documents attend within themselves only. "POS=learned_absolute"
# replaces RoPE by learned absolute position embeddings (16 rows).
# "HYB=pattern" builds a hybrid model (issue 23) from --hybrid-layer-pattern, with A for
# '*' and P for '|' (a '*' would glob here): Mamba layers of 8 heads of 8 channels in 2
# groups of state 8 (TP2: 4 heads and one group per rank), attention without MLP, MLP and
# MoE layers alone; the layer count is the pattern's. "MHD=n" sets the Mamba head dim (FP8
# rows: 2 gives 32 heads, in_proj 192 wide, 96 per TP2 rank, a multiple of 16).
use_variant() {  # "VAR=value ..."
  LAYERS=4 TIED=0 ROUTER="" MBS=2 QKN=0 A2A=auto VOCAB=127 PAD=64 FP8="" MFFN=48 RTOL=1e-5 PAO=0 RC="" FP16=0 OFF=0 MG="" ZATOL=0 BS=""
  EOD=0 PTL=0 MLA=0 MTP=0 PACK=0 POS=rope DENSE=0 HYB="" MHD=8 OPT="" TPMODE="" SCALAR=""
  local setting
  for setting in $1; do
    case $setting in
      FP8=*) FP8=${setting#*=} ;;
      MFFN=*) MFFN=${setting#*=} ;;
      RTOL=*) RTOL=${setting#*=} ;;
      VOCAB=*) VOCAB=${setting#*=} ;;
      PAD=*) PAD=${setting#*=} ;;
      A2A=*) A2A=${setting#*=} ;;
      LAYERS=*) LAYERS=${setting#*=} ;;
      QKN=*) QKN=${setting#*=} ;;
      TIED=*) TIED=${setting#*=} ;;
      ROUTER=*) ROUTER=${setting#*=} ;;
      MBS=*) MBS=${setting#*=} ;;
      PAO=*) PAO=${setting#*=} ;;
      RC=*) RC=${setting#*=} ;;
      FP16=*) FP16=${setting#*=} ;;
      OFF=*) OFF=${setting#*=} ;;
      MG=*) MG=${setting#*=} ;;
      ZATOL=*) ZATOL=${setting#*=} ;;
      EOD=*) EOD=${setting#*=} ;;
      PTL=*) PTL=${setting#*=} ;;
      BS=*) BS=${setting#*=} ;;
      MLA=*) MLA=${setting#*=} ;;
      MTP=*) MTP=${setting#*=} ;;
      PACK=*) PACK=${setting#*=} ;;
      POS=*) POS=${setting#*=} ;;
      DENSE=*) DENSE=${setting#*=} ;;
      HYB=*) HYB=${setting#*=} ;;
      MHD=*) MHD=${setting#*=} ;;
      OPT=*) OPT=${setting#*=} ;;
      TPMODE=*) TPMODE=${setting#*=} ;;
      SCALAR=*) SCALAR=${setting#*=} ;;
      *) echo "FAILED: unknown model variant '$setting'"; exit 1 ;;
    esac
  done
  [[ -z "$FP8" || $1 =~ MFFN= ]] || MFFN=64
}
use_variant ""

run() {  # NAME NP FLAGS...
  local name=$1 np=$2
  shift 2
  mkdir -p "$dir/$name"
  local model=(--micro-batch-size "$MBS" --vocab-size "$VOCAB"
    --make-vocab-size-divisible-by "$PAD")
  if [ -n "$HYB" ]; then
    local pattern=${HYB//A/*}
    model+=(--hybrid-layer-pattern "${pattern//P/|}" --mamba-head-dim "$MHD" --mamba-num-groups 2
      --mamba-state-dim 8)
  else
    model+=(--num-layers "$LAYERS")
  fi
  [ "$DENSE" = 1 ] || model+=(--moe-ffn-hidden-size "$MFFN")
  [ "$TIED" = 1 ] || model+=(--untie-embeddings-and-output-weights)
  [ "$QKN" = 0 ] || model+=(--qk-layernorm)
  [ -z "$FP8" ] || model+=(--fp8-format hybrid --fp8-recipe "$FP8" --kv-channels 16)
  case $PAO in
    0) ;;
    1) model+=(--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16) ;;
    *) model+=(--use-precision-aware-optimizer --exp-avg-dtype "$PAO" --exp-avg-sq-dtype "$PAO") ;;
  esac
  [ "$FP16" = 0 ] || model+=(--fp16 --initial-loss-scale 1024 --loss-scale-window 2)
  [ "$OFF" = 0 ] || model+=(--use-precision-aware-optimizer --optimizer-cpu-offload --optimizer-offload-fraction 0.5)
  [ "$EOD" = 0 ] || model+=(--eod-mask-loss)
  [ "$PTL" = 0 ] || model+=(--calculate-per-token-loss)
  [ "$MLA" = 0 ] || model+=(--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 16
    --qk-head-dim 8 --qk-pos-emb-head-dim 8 --v-head-dim 4 --qk-layernorm --rope-type yarn
    --rotary-scaling-factor 4 --original-max-position-embeddings 4 --mscale 1.0
    --mscale-all-dim 0.707)
  [ "$MTP" = 0 ] || model+=(--mtp-num-layers "$MTP" --mtp-loss-scaling-factor 0.3)
  [ "$PACK" = 0 ] || model+=(--reset-position-ids --reset-attention-mask)
  # shellcheck disable=SC2207
  model+=($(optimizer_flags))
  [ "$POS" = rope ] || model+=(--position-embedding-type "$POS" --max-position-embeddings 16)
  case $MG in
    bf16) model+=(--bf16 --use-precision-aware-optimizer --main-grads-dtype bf16) ;;
    reduce) model+=(--bf16 --grad-reduce-in-bf16) ;;
  esac
  case $RC in
    full) model+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 2) ;;
    block) model+=(--recompute-granularity full --recompute-method block --recompute-num-layers 1) ;;
    sel) model+=(--recompute-granularity selective --recompute-modules core_attn layernorm mlp moe shared_experts)
      [ "$MLA" = 0 ] || model+=(mla_up_proj) ;;
  esac
  # The step schedule replaces --global-batch-size (Megatron refuses both).
  local base=()
  local i
  for ((i = 0; i < ${#config[@]}; ++i)); do
    if [ "$BS" = step ] && [ "${config[i]}" = --global-batch-size ]; then ((++i)); continue; fi
    # DENSE=1: the same model without experts (no router flags below either).
    if [ "$DENSE" = 1 ] && [[ ${config[i]} =~ ^--(num-experts|moe-router-topk)$ ]]; then ((++i)); continue; fi
    base+=("${config[i]}")
  done
  case $BS in
    ramp) model+=(--rampup-batch-size 4 4 8) ;;
    step) model+=(--step-batch-size-schedule "0:4 128:8") ;;
  esac
  # shellcheck disable=SC2207
  [ "$DENSE" = 1 ] || model+=($(router_flags "$ROUTER"))
  local cmd=("$megaton" train "${base[@]}" "${model[@]}" --train-iters "${ITERS:-3}" "$@"
    --save "$dir/$name/save" --save-interval 3 --log-metrics-file "$dir/$name/metrics.jsonl")
  if [ "$np" -gt 1 ]; then cmd=("$mpirun" "$np_flag" "$np" "${mpi_flags[@]}" "${cmd[@]}"); fi
  MEGATON_MOE_ALLTOALL_EXCHANGE=$A2A OMP_NUM_THREADS=1 "${cmd[@]}" >"$dir/$name/out" 2>&1 || {
    echo "FAILED: $name exited with $?"; tail -5 "$dir/$name/out"; return 1; }
}

status=0
# The one-rank run of a model variant, run on first use: sets $reference (its name).
# A layout may give its reference's variant in a fifth field (default: its own).
reference_of() {  # VARIANT
  reference=one-rank${1:+-${1// /-}}
  [ -e "$dir/$reference" ] || run "$reference" 1
}
# The optimizer variant: "OPT=name" trains with --optimizer name (issue 24); Muon runs use
# --muon-extra-scale-factor 0.2 (Moonlight's match to Adam's update RMS, so the config's lr
# suits both), "TPMODE=mode" sets --muon-tp-mode, "SCALAR=lion" --muon-scalar-optimizer lion.
optimizer_flags() {
  [ -z "$OPT" ] && return 0
  local flags=(--optimizer "$OPT")
  if [ "$OPT" = muon ]; then
    flags+=(--muon-extra-scale-factor 0.2)
    [ -z "$TPMODE" ] || flags+=(--muon-tp-mode "$TPMODE")
    [ -z "$SCALAR" ] || flags+=(--muon-scalar-optimizer "$SCALAR")
  fi
  echo "${flags[@]}"
}

# Every entry of `layouts` ("name | ranks | flags | model variant | reference variant")
# against its one-rank reference; sets status=1 on a failure.
compare_layouts() {
  local entry name np flags variant ref_variant out
  for entry in "${layouts[@]}"; do
    IFS='|' read -r name np flags variant ref_variant <<<"$entry"
    [[ -z "${LAYOUTS_ONLY:-}" || $name =~ $LAYOUTS_ONLY ]] || continue
    if [ -n "$ref_variant" ]; then
      use_variant "$ref_variant"
      reference_of "$ref_variant" || { status=1; continue; }
    fi
    use_variant "$variant"
    [ -n "$ref_variant" ] || reference_of "$variant" || { status=1; continue; }
    # shellcheck disable=SC2086
    if run "$name" "$np" $flags; then
      if out=$(python3 "$compare" --rtol "$RTOL" --num-zeros-atol "$ZATOL" "$dir/$reference" "$dir/$name"); then
        echo "ok: $name ($np ranks): $out"
      else
        echo "FAILED: $name ($np ranks) differs from one rank:"; echo "$out"; status=1
      fi
    else
      status=1
    fi
  done
}

# A checkpoint written under one layout resumes under another: 2 steps on one layout,
# the third on another, against the one-rank run's third step and parameters.
resume() {  # NAME SRC_NP "SRC FLAGS" DST_NP "DST FLAGS"
  local name=$1 out
  # shellcheck disable=SC2086
  ITERS=2 run "$name-first" "$2" $3 || return 1
  # shellcheck disable=SC2086
  run "$name" "$4" --load "$dir/$name-first/save" $5 || return 1
  if out=$(python3 "$compare" --resumed --rtol "$RTOL" --num-zeros-atol "$ZATOL" "$dir/$reference" "$dir/$name"); then
    echo "ok: resume $name: $out"
  else
    echo "FAILED: resume $name differs from one rank:"; echo "$out"; return 1
  fi
}
# Every entry of `resumes` ("name | ranks | flags of the first two steps | ranks | flags of
# the third | model variant"); sets status=1 on a failure.
compare_resumes() {
  local entry name src_np src_flags dst_np dst_flags variant
  for entry in "${resumes[@]}"; do
    IFS='|' read -r name src_np src_flags dst_np dst_flags variant <<<"$entry"
    [[ -z "${LAYOUTS_ONLY:-}" || $name =~ $LAYOUTS_ONLY ]] || continue
    use_variant "$variant"
    reference_of "$variant" || { status=1; continue; }
    resume "$name" "$src_np" "$src_flags" "$dst_np" "$dst_flags" || status=1
  done
}
