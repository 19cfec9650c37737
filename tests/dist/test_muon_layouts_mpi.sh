#!/usr/bin/env bash
# Muon, SGD and Lion (issue 24) under every parallel layout reproduce the one-rank run, as
# test_layouts_mpi.sh checks Adam's: 3 steps of the small MoE config (Muon with
# --muon-extra-scale-factor 0.2), lm losses, grad norms and the saved parameters within
# RTOL (tools/compare_runs.py). The layer-wise distributed optimizer (Muon with
# --use-distributed-optimizer: each data-parallel rank owns whole matrices) and the
# replicated update give the one-rank numbers; the TP modes duplicated and distributed
# orthogonalise the whole matrix (blockwise depends on the TP size by design, and is
# compared with a run of the same TP size); checkpoints hold the state by parameter, so a
# run resumes under another DP size, layout or TP mode.
# Usage: test_muon_layouts_mpi.sh MEGATON MPIRUN NP_FLAG NP [MPIRUN FLAGS...]
# LAYOUTS_ONLY=REGEX runs only the layouts and resumes whose names match (by hand).
set -uo pipefail
megaton=$1 mpirun=$2 np_flag=$3
shift 4
mpi_flags=("$@")
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/dist/layouts_lib.sh
source "$here/layouts_lib.sh"

overlap="--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 3000"
# name | ranks | flags | model variant
layouts=(
  "muon-dp2-replicated|2||OPT=muon"
  "muon-dp2-layerwise|2|--use-distributed-optimizer|OPT=muon"
  "muon-dp2-layerwise-overlap|2|--use-distributed-optimizer $overlap|OPT=muon"
  "muon-dp4-layerwise-overlap|4|--use-distributed-optimizer $overlap|OPT=muon"
  "muon-tp2-sp-duplicated|2|--tensor-model-parallel-size 2 --sequence-parallel|OPT=muon"
  "muon-tp2-sp-distributed|2|--tensor-model-parallel-size 2 --sequence-parallel|OPT=muon TPMODE=distributed"
  "muon-ep2-layerwise|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --use-distributed-optimizer|OPT=muon"
  "muon-ep2-etp2|4|--expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel|OPT=muon"
  # The layer-wise buffers sharded over DP (dense) and expert DP while their matrices need
  # TP (dense) and expert-TP collectives: owners of one matrix pair up over TP.
  "muon-tp2-etp2-dp2-layerwise|4|--tensor-model-parallel-size 2 --expert-tensor-parallel-size 2 --sequence-parallel --use-distributed-optimizer|OPT=muon"
  "muon-tp2-etp2-dp2-layerwise-distributed|4|--tensor-model-parallel-size 2 --expert-tensor-parallel-size 2 --sequence-parallel --use-distributed-optimizer|OPT=muon TPMODE=distributed"
  "muon-pp2|2|--pipeline-model-parallel-size 2|OPT=muon"
  "muon-pp2-dp2-layerwise-tied|4|--pipeline-model-parallel-size 2 --use-distributed-optimizer|OPT=muon TIED=1"
  "muon-hyb-dp2-layerwise|2|--use-distributed-optimizer|OPT=muon HYB=M-MA-ME"
  "muon-scalar-lion-dp2-layerwise|2|--use-distributed-optimizer|OPT=muon SCALAR=lion"
  # Multi-latent attention's projections (the down projections replicated over TP), MTP's
  # eh_proj on the last stage, context parallelism's dp_cp group of the layer-wise buffers.
  "muon-mla-tp2-sp|2|--tensor-model-parallel-size 2 --sequence-parallel|OPT=muon MLA=1"
  "muon-mtp-pp2|2|--pipeline-model-parallel-size 2|OPT=muon MTP=1"
  "muon-cp2-dp2-layerwise|4|--context-parallel-size 2 --use-distributed-optimizer|OPT=muon"
  "lion-dp2-distopt|2|--use-distributed-optimizer|OPT=lion"
  # SGD under Megatron-FSDP (Megatron allows SGD and Adam there): flat shards, elementwise.
  "sgd-fsdp-dp2|2|--use-megatron-fsdp|OPT=sgd"
  "sgd-dp2-distopt|2|--use-distributed-optimizer|OPT=sgd"
  # Blockwise orthogonalises each TP slice: its numbers depend on the TP size, so DP2 x TP2
  # with the layer-wise optimizer is compared with TP2 alone (the fifth field).
  "muon-tp2-blockwise-dp2-layerwise|4|--tensor-model-parallel-size 2 --use-distributed-optimizer|OPT=muon TPMODE=blockwise|TP2BLOCK"
)
# name | ranks, flags of the first two steps | ranks, flags of the third | model variant
resumes=(
  "muon-dp2-layerwise-to-dp4-layerwise|2|--use-distributed-optimizer|4|--use-distributed-optimizer|OPT=muon"
  "muon-dp4-layerwise-to-one-rank|4|--use-distributed-optimizer|1||OPT=muon"
  "muon-one-rank-to-tp2-sp-dp2-layerwise|1||4|--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer|OPT=muon"
  "muon-replicated-dp2-to-dp2-ep2-layerwise|2||4|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --use-distributed-optimizer|OPT=muon"
  "muon-tp2-duplicated-to-tp2-distributed|2|--tensor-model-parallel-size 2|2|--tensor-model-parallel-size 2 --muon-tp-mode distributed|OPT=muon"
  "lion-dp2-distopt-to-one-rank|2|--use-distributed-optimizer|1||OPT=lion"
)

# The TP2 blockwise reference: the same TP size, one data-parallel rank.
reference_of_tp2_blockwise() {
  use_variant "OPT=muon TPMODE=blockwise"
  reference=muon-tp2-blockwise
  [ -e "$dir/$reference" ] || run "$reference" 2 --tensor-model-parallel-size 2
}

for entry in "${layouts[@]}"; do
  IFS='|' read -r name np flags variant special <<<"$entry"
  [[ -z "${LAYOUTS_ONLY:-}" || $name =~ $LAYOUTS_ONLY ]] || continue
  if [ "$special" = TP2BLOCK ]; then
    reference_of_tp2_blockwise || { status=1; continue; }
    use_variant "$variant"
  else
    use_variant "$variant"
    reference_of "$variant" || { status=1; continue; }
  fi
  # shellcheck disable=SC2086
  if run "$name" "$np" $flags; then
    if out=$(python3 "$compare" --rtol "$RTOL" --num-zeros-atol "$ZATOL" "$dir/$reference" "$dir/$name"); then
      echo "ok: $name ($np ranks): $out"
    else
      echo "FAILED: $name ($np ranks) differs from its reference:"; echo "$out"; status=1
    fi
  else
    status=1
  fi
done
compare_resumes
exit $status
