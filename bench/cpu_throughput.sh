#!/usr/bin/env bash
# CPU training throughput of a demo config: runs N iterations (default 12) and reports
# the median tokens/s and model TFLOP/s of the logged iterations after the first two.
# Usage: bash bench/cpu_throughput.sh [configs/demo-moe.yaml] [iterations]
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/demo-moe.yaml}
iters=${2:-12}
bash tools/prepare_fortunes.sh
log=$(mktemp)
build/megaton train --config "$config" --train-iters "$iters" --log-interval 1 \
  --eval-iters 0 --save-interval 0 --lr-warmup-iters 1 > "$log"
python3 - "$log" "$config" <<'PY'
import re, statistics, sys
rows = [l for l in open(sys.argv[1]) if l.startswith(" iteration")]
tok = [float(re.search(r"tokens per second: ([\d.]+)", l).group(1)) for l in rows][2:]
tfl = [float(re.search(r"TFLOP/s/GPU\): ([\d.]+)", l).group(1)) for l in rows][2:]
mem = re.search(r"peak memory \(MB\): ([\d.]+)", rows[-1]).group(1)
print(f"{sys.argv[2]}: median tokens/s {statistics.median(tok):.0f}, "
      f"model TFLOP/s {statistics.median(tfl):.4f}, peak memory {mem} MB "
      f"({len(tok)} iterations timed)")
PY
rm -f "$log"
