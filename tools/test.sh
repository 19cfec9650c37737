#!/usr/bin/env bash
# The README's test command: installs what is missing, builds, runs every CPU test and
# the `dist` tests (CPU ranks under mpirun).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
bash tools/build.sh
ctest --test-dir build -L 'cpu|dist' --output-on-failure -j"$(nproc)" --timeout 900
