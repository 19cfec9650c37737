#!/usr/bin/env bash
# Resume on the GPU in bf16 and each FP8 recipe: demo-dense for 6 iterations straight, and
# 3 + save + 3 resumed from the checkpoint; prints the lm losses of iterations 4-6 of both
# and whether they are identical. Run on the GPU machine from the repository root, with the
# demo data in data/ (tools/prepare_fortunes.sh). Usage: bash tools/gpu_resume_check.sh MEGATON
set -uo pipefail
B=$1
ck=$(mktemp -d)
trap 'rm -rf "$ck"' EXIT
status=0
for f in "" "--fp8-format hybrid --fp8-recipe tensorwise" \
         "--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4 --fp8-amax-compute-algo max" \
         "--fp8-format hybrid --fp8-recipe blockwise"; do
  base="train --config configs/demo-dense.yaml --device cuda --bf16 --train-iters 6 --log-interval 1 --eval-interval 1000 --eval-iters 0 --save-interval 3 --lr-warmup-iters 2"
  losses() { grep -oE "iteration +[456]/.*lm loss: [0-9.E+-]+" | grep -oE "lm loss: [0-9.E+-]+" | tr '\n' ' '; }
  # shellcheck disable=SC2086
  a=$("$B" $base $f 2>&1 | losses)
  rm -rf "$ck/save"
  # shellcheck disable=SC2086
  "$B" $base $f --save "$ck/save" --exit-interval 3 >/dev/null 2>&1
  # shellcheck disable=SC2086
  b=$("$B" $base $f --load "$ck/save" 2>&1 | losses)
  echo "${f:-bf16}"; echo "  straight: $a"; echo "  resumed:  $b"
  if [ -n "$a" ] && [ "$a" = "$b" ]; then echo "  identical"; else echo "  DIFFERENT"; status=1; fi
done
exit $status
