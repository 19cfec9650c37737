#!/usr/bin/env bash
# Packs executables built here, with the shared libraries a CUDA 13 / Ubuntu 24.04 GPU
# machine may lack (fmt, yaml-cpp, SentencePiece, OpenBLAS, GoogleTest ...), into one
# folder to carry there. CUDA, cuDNN, NVRTC and the C runtime are expected on the GPU
# machine and are left out. Run there as: LD_LIBRARY_PATH=$DIR/lib $DIR/bin/megaton ...
# Usage: bash tools/gpu_bundle.sh OUT_DIR EXECUTABLE...
set -euo pipefail
out=$1; shift
rm -rf "$out"; mkdir -p "$out/bin" "$out/lib"
# MPI and NCCL come from the GPU machine itself (its mpirun must match its libmpi).
skip='^(libc|libm|libdl|librt|libpthread|ld-linux|libcuda|libcudnn|libcublas|libnvrtc|libcudart|libgcc_s|libstdc\+\+|libmpi|libopen-(rte|pal)|libpmix|libhwloc|libevent|libnccl|libucx|libucp|libucs|libuct|libfabric)'
for exe in "$@"; do
  cp "$exe" "$out/bin/"
  ldd "$exe" | awk '/=> \//{print $1, $3}' | while read -r name path; do
    if ! [[ $name =~ $skip ]] && [ ! -e "$out/lib/$name" ]; then cp -L "$path" "$out/lib/$name"; fi
  done
done
du -sh "$out"
