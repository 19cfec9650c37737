#!/usr/bin/env bash
# Installs the Debian packages Megaton builds and runs with (skips those present).
set -euo pipefail
packages=(
  build-essential cmake pkg-config     # compiler and build
  libopenblas-dev libopenblas-openmp-dev  # CPU GEMM (the OpenMP build)
  libsentencepiece-dev sentencepiece   # tokenizer
  libpcre2-dev libutf8proc-dev         # byte-level BPE tokenizers (regex, NFC)
  libyaml-cpp-dev                      # configs/*.yaml
  nlohmann-json3-dev                   # checkpoint metadata, safetensors headers
  zlib1g-dev                           # crc32 checksums of sharded checkpoints
  libcli11-dev                         # command line
  libfmt-dev                           # formatting
  libgtest-dev libbenchmark-dev        # tests and benchmarks
  liblapacke-dev                       # Muon's Newton-Schulz tests against an SVD
  libopenmpi-dev openmpi-bin           # MPI: launch (mpirun), CPU collectives, dist tests
  fortunes fortunes-min                # the demo corpus
  python3-matplotlib                   # tools/plot_loss.py: loss-curve PNGs (Agg backend)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "installing: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
