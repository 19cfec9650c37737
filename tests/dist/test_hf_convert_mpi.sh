#!/usr/bin/env bash
# `megaton convert` end to end with the binary alone: a tiny Qwen3-MoE-style model (GQA,
# --qk-layernorm, 4 experts top-2) trained 3 iterations is exported to Hugging Face (fp32)
# and converted back, for one rank and for TP2 x EP2 (ETP1); re-exporting the sharded one
# gives the same safetensors bytes; the first `train --finetune` loss from the original
# checkpoint, from the one-rank conversion (one process), and from the sharded conversion
# under mpirun on 2 ranks as TP2 x EP2 with sequence parallelism and as DP2 x EP2 agree
# (relative 1e-5; the one-process ones exactly); `train --load` of the Hugging Face
# directory itself gives the same losses, one process and TP2 x EP2, and leaves nothing in
# $TMPDIR; without --finetune / --no-load-optim it is one line and exit 2. A generated
# 12-layer bf16 Llama converts with its peak resident memory (above the binary's own) under
# 30% of its fp32 checkpoint, and exports back into 100 MB shards under 70%.
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

# Memory: a 12-layer Llama-shaped bf16 model (hidden 1024, FFN 4096, vocabulary 8000: 0.44 GB
# of bf16, 0.87 GB as fp32) converts with the files mapped and one tensor made at a time:
# the peak resident memory stays under 30% of the fp32 checkpoint it writes (measured above
# the binary's own: 110-126 MB for 871 MB; reading the whole model, as before, peaked at
# 2.4x the fp32 size).
python3 - "$dir/big_hf" 12 1024 4096 8000 <<'EOF' >/dev/null || fail "generating the large model"
import json, os, struct, sys
# A Llama-shaped HF directory of bf16 tensors (elements alternating 2^-7 and -2^-6),
# written without numpy: config.json and model.safetensors.
out, layers, hidden, ffn, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
os.makedirs(out, exist_ok=True)
heads = hidden // 64
shapes = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden], "lm_head.weight": [vocab, hidden]}
for i in range(layers):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": [hidden], p + "post_attention_layernorm.weight": [hidden],
                   p + "self_attn.q_proj.weight": [hidden, hidden], p + "self_attn.k_proj.weight": [hidden, hidden],
                   p + "self_attn.v_proj.weight": [hidden, hidden], p + "self_attn.o_proj.weight": [hidden, hidden],
                   p + "mlp.gate_proj.weight": [ffn, hidden], p + "mlp.up_proj.weight": [ffn, hidden],
                   p + "mlp.down_proj.weight": [hidden, ffn]})
header, offset = {}, 0
for name, shape in shapes.items():
    n = 1
    for d in shape: n *= d
    header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + 2 * n]}
    offset += 2 * n
h = json.dumps(header).encode()
h += b" " * ((8 - len(h) % 8) % 8)
row = bytes([0x00, 0x3c, 0x80, 0xbc]) * 512  # bf16 0x3c00 = 2^-7, 0xbc80 = -2^-6; 2 KiB
with open(os.path.join(out, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(h))); f.write(h)
    left = offset
    while left > 0:
        k = min(left, len(row)); f.write(row[:k]); left -= k
json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
           "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": heads, "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 2048, "tie_word_embeddings": False, "hidden_act": "silu"},
          open(os.path.join(out, "config.json"), "w"))
print(offset, "bytes of bf16 tensors")
EOF
# The binary's own resident memory (its shared libraries: some 250 MB in a CUDA build) is
# measured alone and taken off.
baseline=$(python3 - "$megaton" <<'EOF'
import resource, subprocess, sys
subprocess.run([sys.argv[1], "convert", "--help"], capture_output=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
EOF
)
python3 - "$megaton" "$dir/big_hf" "$dir/big" "$baseline" <<'EOF' || fail "the large conversion's memory"
import os, resource, subprocess, sys
megaton, hf, out, baseline = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
r = subprocess.run([megaton, "convert", "--from", "hf", hf, "--save", out], capture_output=True, text=True)
if r.returncode != 0:
    sys.exit("convert failed: " + r.stderr.strip())
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 - baseline
size = os.path.getsize(os.path.join(out, "iter_0000000", "rank_00000.safetensors"))
print("large conversion: peak resident %.0f MB above the binary's %.0f MB, for a %.0f MB fp32 "
      "checkpoint" % (rss / 1e6, baseline / 1e6, size / 1e6))
sys.exit(0 if rss < 0.3 * size else "peak resident memory is over 30% of the checkpoint")
EOF
# And back, one decoder layer at a time into 100 MB shards: under 70% of the fp32 checkpoint
# (measured 295-411 MB of 871 MB: a layer in fp32 and its copies, one shard of bf16; reading
# the whole checkpoint, as before, needed more than all of it).
python3 - "$megaton" "$dir/big" "$dir/big_export" "$baseline" <<'EOF' || fail "the large export's memory"
import os, resource, subprocess, sys
megaton, ckpt, out, baseline = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
r = subprocess.run([megaton, "convert", "--load", ckpt, "--to", "hf", out, "--max-shard-size",
                    "100000000"], capture_output=True, text=True)
if r.returncode != 0:
    sys.exit("export failed: " + r.stderr.strip())
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 - baseline
size = os.path.getsize(os.path.join(ckpt, "iter_0000000", "rank_00000.safetensors"))
shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
print("large export: peak resident %.0f MB above the binary's, for a %.0f MB fp32 checkpoint, %d shards" %
      (rss / 1e6, size / 1e6, len(shards)))
if shards != ["model-%05d-of-00005.safetensors" % i for i in range(1, 6)]:
    sys.exit("expected 5 shards, got %s" % shards)
sys.exit(0 if rss < 0.7 * size else "peak resident memory is over 70% of the checkpoint")
EOF
rm -rf "$dir/big_hf" "$dir/big" "$dir/big_export"
