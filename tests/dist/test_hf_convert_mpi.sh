#!/usr/bin/env bash
# `megaton convert` end to end with the binary alone: a tiny Qwen3-MoE-style model (GQA,
# --qk-layernorm, 4 experts top-2) trained 3 iterations is exported to Hugging Face (fp32)
# and converted back, for one rank and for TP2 x EP2 (ETP1); re-exporting the sharded one
# gives the same safetensors bytes; the first `train --finetune` loss from the original
# checkpoint, from the one-rank conversion (one process), and from the sharded conversion
# under mpirun on 2 ranks as TP2 x EP2 with sequence parallelism and as DP2 x EP2 agree
# (relative 1e-5; the one-process ones exactly); `train --load` of the Hugging Face
# directory itself gives the same losses, one process and TP2 x EP2, and leaves nothing in
# $TMPDIR; without --finetune / --no-load-optim it is one line and exit 2.
# Usage: test_hf_convert_mpi.sh MEGATON MPIRUN [MPIRUN FLAGS...] (the flags include -n 2)
set -uo pipefail
megaton=$1
shift
launcher=("$@")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() {
  echo "FAILED: $*"
  [ -f "$dir/err" ] && { echo "--- stderr:"; cat "$dir/err"; }
  exit 1
}
model=(--tokenizer-type NullTokenizer --vocab-size 63 --make-vocab-size-divisible-by 1
  --num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention
  --num-query-groups 2 --kv-channels 16 --qk-layernorm --ffn-hidden-size 48 --num-experts 4
  --moe-ffn-hidden-size 24 --moe-router-topk 2 --swiglu --normalization RMSNorm
  --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear
  --hidden-dropout 0 --attention-dropout 0)
run=(--mock-data --seq-length 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3
  --eval-iters 0 --log-interval 1 --device cpu)
"$megaton" train "${model[@]}" "${run[@]}" --train-iters 3 --save "$dir/trained" \
  >"$dir/out" 2>"$dir/err" || fail "training the model"
"$megaton" convert --load "$dir/trained" --to hf "$dir/hf" --export-dtype fp32 \
  >"$dir/out" 2>"$dir/err" || fail "export"
grep -q '"model_type": "qwen3_moe"' "$dir/hf/config.json" || fail "model_type is not qwen3_moe"
"$megaton" convert --from hf "$dir/hf" --save "$dir/one" --make-vocab-size-divisible-by 1 \
  >"$dir/out" 2>"$dir/err" || fail "import for one rank"
"$megaton" convert --from hf "$dir/hf" --save "$dir/sharded" --make-vocab-size-divisible-by 1 \
  --target-tensor-model-parallel-size 2 --target-expert-model-parallel-size 2 \
  --target-expert-tensor-parallel-size 1 >"$dir/out" 2>"$dir/err" || fail "import for TP2 x EP2"
[ -f "$dir/sharded/iter_0000000/rank_00001.safetensors" ] || fail "no second rank file"
"$megaton" convert --load "$dir/sharded" --to hf "$dir/hf2" --export-dtype fp32 \
  >"$dir/out" 2>"$dir/err" || fail "re-export"
cmp -s "$dir/hf/model.safetensors" "$dir/hf2/model.safetensors" ||
  fail "the re-exported model.safetensors differs"

finetune=(train --use-checkpoint-args --finetune --make-vocab-size-divisible-by 1 "${run[@]}"
  --train-iters 1)
first_loss() {  # NAME: the lm_loss of $dir/NAME.jsonl's first line
  python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["lm_loss"])' \
    "$dir/$1.jsonl"
}
"$megaton" "${finetune[@]}" --load "$dir/trained" --log-metrics-file "$dir/trained.jsonl" \
  >"$dir/out" 2>"$dir/err" || fail "finetune from the trained checkpoint"
"$megaton" "${finetune[@]}" --load "$dir/one" --log-metrics-file "$dir/one.jsonl" \
  >"$dir/out" 2>"$dir/err" || fail "finetune from the one-rank conversion"
"${launcher[@]}" "$megaton" "${finetune[@]}" --load "$dir/sharded" --tensor-model-parallel-size 2 \
  --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --sequence-parallel \
  --log-metrics-file "$dir/tp2.jsonl" >"$dir/out" 2>"$dir/err" || fail "finetune under TP2 x EP2"
"${launcher[@]}" "$megaton" "${finetune[@]}" --load "$dir/sharded" --expert-model-parallel-size 2 \
  --log-metrics-file "$dir/dp2.jsonl" >"$dir/out" 2>"$dir/err" || fail "finetune under DP2 x EP2"
# --load of the Hugging Face directory itself: imported to $TMPDIR first, removed at the end.
mkdir -p "$dir/tmp"
TMPDIR="$dir/tmp" "$megaton" "${finetune[@]}" --load "$dir/hf" --log-metrics-file "$dir/hfload.jsonl" \
  >"$dir/out" 2>"$dir/err" || fail "finetune from --load of the Hugging Face directory"
grep -q "importing the Hugging Face model" "$dir/out" || fail "no import line for --load of hf"
TMPDIR="$dir/tmp" "${launcher[@]}" -x TMPDIR "$megaton" "${finetune[@]}" --load "$dir/hf" \
  --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 \
  --sequence-parallel --log-metrics-file "$dir/hftp2.jsonl" >"$dir/out" 2>"$dir/err" ||
  fail "finetune from --load of the Hugging Face directory under TP2 x EP2"
[ -z "$(ls -A "$dir/tmp")" ] || fail "--load of hf left $(ls "$dir/tmp") in TMPDIR"
TMPDIR="$dir/tmp" "$megaton" train --use-checkpoint-args "${run[@]}" --train-iters 1 \
  --load "$dir/hf" >"$dir/out" 2>"$dir/err"
status=$?
[ $status -eq 2 ] || fail "--load of hf without --finetune: exit $status, want 2"
[ "$(wc -l <"$dir/err")" -eq 1 ] && grep -q -- "--finetune" "$dir/err" ||
  fail "--load of hf without --finetune: not one line naming --finetune"
[ -z "$(ls -A "$dir/tmp")" ] || fail "a refused --load of hf left $(ls "$dir/tmp") in TMPDIR"
rm -f "$dir/err"

want=$(first_loss trained)
for name in one hfload; do
  [ "$(first_loss $name)" = "$want" ] || fail "$name: loss $(first_loss $name), want $want"
done
for name in tp2 dp2 hftp2; do
  python3 -c 'import sys; a, b = map(float, sys.argv[1:]); sys.exit(abs(a - b) > 1e-5 * abs(b))' \
    "$(first_loss $name)" "$want" || fail "$name: loss $(first_loss $name), want $want"
done
echo "ok: first finetune loss $want from the trained checkpoint and every conversion"
