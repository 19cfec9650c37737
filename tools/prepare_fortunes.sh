#!/usr/bin/env bash
# Trains the demo's SentencePiece tokenizer on the fortunes corpus and preprocesses the
# corpus into data/fortunes_text_document.{bin,idx} (skips what exists). Needs build/.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p data
megaton=build/megaton
corpus=/usr/share/games/fortunes
if [ ! -f data/fortunes_sp.model ]; then
  $megaton tokenizer train --input "$corpus" --input-format fortune --vocab-size 8000 \
    --output-prefix data/fortunes_sp
fi
if [ ! -f data/fortunes_text_document.idx ]; then
  $megaton preprocess --input "$corpus" --input-format fortune --output-prefix data/fortunes \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model data/fortunes_sp.model --workers 2
fi
