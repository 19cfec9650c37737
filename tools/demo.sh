#!/usr/bin/env bash
# The README's main command: install, build, train a SentencePiece tokenizer on the
# fortunes corpus, preprocess it, train the demo MoE GPT (configs/demo-moe.yaml, or the
# config given as $1), and print a sample.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/demo-moe.yaml}
bash tools/install_deps.sh
bash tools/build.sh
bash tools/prepare_fortunes.sh
megaton=build/megaton
name=$(basename "$config" .yaml)
rm -rf "runs/$name"
mkdir -p runs
$megaton train --config "$config" --save "runs/$name" | tee "runs/$name.log"
first=$(grep -m1 "validation loss at iteration 0" "runs/$name.log" | sed 's/.*lm loss value: \([^ ]*\).*/\1/')
last=$(grep "validation loss at the end" "runs/$name.log" | sed 's/.*lm loss value: \([^ ]*\).*/\1/')
echo
echo "validation loss: before training $first, after training $last"
python3 -c "import sys; f,l=float('$first'),float('$last'); print(f'ratio after/before: {l/f:.3f} (target <= 0.6)'); sys.exit(0 if l <= 0.6*f else 1)"
echo
echo "sample (top-p 0.9, temperature 0.8):"
$megaton generate --load "runs/$name" --prompt "The meaning of life is" --temperature 0.8 \
  --top-p 0.9 --tokens-to-generate 80 --seed 7
