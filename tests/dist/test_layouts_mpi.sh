#!/usr/bin/env bash
# Every implemented parallel layout reproduces the one-rank run: 3 training steps of a
# small MoE config on CPU ranks under mpirun, whose lm losses, grad norms and parameters
# after the steps (the saved checkpoint) match the one-rank run's to a relative
# difference of 1e-5 (tools/compare_runs.py). A layout may use a variant of the model
# (more layers, tied embeddings); it is then compared with the one-rank run of that variant.
# Usage: test_layouts_mpi.sh MEGATON MPIRUN NP_FLAG NP [MPIRUN FLAGS...]
# LAYOUTS_ONLY=REGEX runs only the layouts and resumes whose names match (by hand).
# (CTest passes NP = 2; each layout below sets its own rank count.)
set -uo pipefail
megaton=$1 mpirun=$2 np_flag=$3
shift 4
mpi_flags=("$@")
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/dist/layouts_lib.sh
source "$here/layouts_lib.sh"
run one-rank 1 || exit 1
# name | ranks | flags | model variant (empty: the config's)
layouts=(
  "dp2|2|"
  "dp2-distributed-optimizer|2|--use-distributed-optimizer"
  "dp4-distributed-optimizer|4|--use-distributed-optimizer"
  # Expert parallelism: 4 experts, top-2. Expert gradients add the tokens of every rank of
  # the expert-model-parallel group.
  "ep2-alltoall|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
  "ep2-allgather|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"
  "dp2-ep2-alltoall|4|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
  "dp2-ep2-allgather|4|--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"
  "ep4-alltoall-distributed-optimizer|4|--expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall --use-distributed-optimizer"
  "dp2-ep2-distributed-optimizer|4|--expert-model-parallel-size 2 --use-distributed-optimizer"
  "ep2-etp2-alltoall|4|--expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --moe-token-dispatcher-type alltoall"
  "ep2-etp2-allgather|4|--expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --moe-token-dispatcher-type allgather"
  # With tensor parallelism (etp defaults to tp): the MoE layer sees T / tp token rows.
  "tp2-sp-ep2-etp1-alltoall|2|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall"
  "tp2-sp-ep2-etp1-allgather|2|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type allgather"
  "tp2-sp-etp1|2|--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1"
  "tp2-etp1-alltoall|2|--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall"
  "tp2-sp-ep2-distributed-optimizer|4|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --use-distributed-optimizer --moe-token-dispatcher-type alltoall"
  # Context parallelism: each rank holds chunks r and 2cp-1-r of every sample; the attention
  # reaches the other chunks by the K/V ring (p2p), an all-gather of K/V, or a heads
  # all-to-all (a2a); the gradients are reduced over DP x CP.
  "cp2-p2p|2|--context-parallel-size 2 --cp-comm-type p2p"
  "cp2-all-gather|2|--context-parallel-size 2 --cp-comm-type all_gather"
  "cp2-a2a|2|--context-parallel-size 2 --cp-comm-type a2a"
  "cp4-p2p|4|--context-parallel-size 4"
  "cp4-all-gather|4|--context-parallel-size 4 --cp-comm-type all_gather"
  "cp4-a2a|4|--context-parallel-size 4 --cp-comm-type a2a"
  "cp2-tp2-sp|4|--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel"
  "cp2-ep2|2|--context-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
  "cp2-pp2|4|--context-parallel-size 2 --pipeline-model-parallel-size 2"
  "cp2-dp2-distributed-optimizer|4|--context-parallel-size 2 --use-distributed-optimizer"
  # Megatron-FSDP: one bucket per unit (embedding, layer, tail); optim shards the optimizer
  # state, optim_grads the gradients too (reduce-scattered into each rank's shard after
  # every micro-batch), optim_grads_params the weights too (gathered per unit, one ahead).
  # Dense params over DP x CP, experts over EDP; 2 micro-batches per rank at DP2.
  "fsdp-optim-dp2|2|--use-megatron-fsdp --data-parallel-sharding-strategy optim"
  "fsdp-optim-grads-dp2|2|--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads"
  "fsdp-optim-grads-params-dp2|2|--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
  # --fsdp-double-buffer: the layers' gathered weights and gradients in two alternating slots.
  "fsdp-double-buffer-dp2|2|--use-megatron-fsdp --fsdp-double-buffer"
  "fsdp-double-buffer-optim-grads-dp4|4|--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --fsdp-double-buffer"
  "fsdp-double-buffer-dp2-ep2-recompute|2|--use-megatron-fsdp --fsdp-double-buffer --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|RC=full"
  "fsdp-optim-dp4|4|--use-megatron-fsdp --data-parallel-sharding-strategy optim"
  "fsdp-optim-grads-dp4|4|--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads"
  "fsdp-optim-grads-params-dp4|4|--use-megatron-fsdp"
  "fsdp-no-shard-dp2|2|--use-megatron-fsdp --data-parallel-sharding-strategy no_shard"
  "fsdp-dp2-ep2|4|--use-megatron-fsdp --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
  "fsdp-tp2-sp-dp2|4|--use-megatron-fsdp --tensor-model-parallel-size 2 --sequence-parallel"
  "fsdp-cp2-dp2|4|--use-megatron-fsdp --context-parallel-size 2 --cp-comm-type a2a"
  "fsdp-pp2-dp2-tied|4|--use-megatron-fsdp --pipeline-model-parallel-size 2|TIED=1"
  "fsdp-dp2-tied-recompute|2|--use-megatron-fsdp|TIED=1 RC=full"
  # --init-model-with-meta-device: each rank draws only what it stores; same run.
  "fsdp-meta-dp2|2|--use-megatron-fsdp --init-model-with-meta-device"
  "fsdp-meta-optim-grads-dp2|2|--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --init-model-with-meta-device"
  "fsdp-meta-no-shard-dp2|2|--use-megatron-fsdp --data-parallel-sharding-strategy no_shard --init-model-with-meta-device"
  "fsdp-meta-dp2-ep2|4|--use-megatron-fsdp --init-model-with-meta-device --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
  "fsdp-meta-tp2-sp-dp2|4|--use-megatron-fsdp --init-model-with-meta-device --tensor-model-parallel-size 2 --sequence-parallel"
  "fsdp-meta-pp2-dp2-tied|4|--use-megatron-fsdp --init-model-with-meta-device --pipeline-model-parallel-size 2|TIED=1"
  # Pipeline parallelism: 1F1B, interleaved 1F1B (8 layers: two 1-layer chunks per rank
  # on pp 4), uneven first/last stages, tied embeddings synchronised between the stages.
  "tp2|2|--tensor-model-parallel-size 2"
  "tp2-sp|2|--tensor-model-parallel-size 2 --sequence-parallel"
  # --tp-comm-overlap: the sequence all-gathers and reduce-scatters beside the GEMMs
  # (model/tp_comm_overlap.h); the same sums, GEMMs cut into row blocks.
  "tp2-sp-tp-comm-overlap|2|--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap"
  "tp2-sp-tp-comm-overlap-pp2-dp2-distopt|8|--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap --pipeline-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000"
  "tp2-sp-tp-comm-overlap-ep2-recompute|4|--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|RC=full"
  "pp2|2|--pipeline-model-parallel-size 2"
  "pp4|4|--pipeline-model-parallel-size 4"
  "pp2-dp2|4|--pipeline-model-parallel-size 2"
  "pp2-dp2-distributed-optimizer|4|--pipeline-model-parallel-size 2 --use-distributed-optimizer"
  "pp3-uneven|3|--pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 2"
  "pp4-interleaved|4|--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1|LAYERS=8"
  "pp2-interleaved-uneven|2|--pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 2 --num-layers-per-virtual-pipeline-stage 3|LAYERS=8"
  "pp2-tied|2|--pipeline-model-parallel-size 2|TIED=1"
  # Each tick's transfers finished in the tick (the default overlaps them: Megatron's
  # overlap_p2p_comm, train/pipeline_schedule.h).
  "pp2-no-overlap-p2p|2|--pipeline-model-parallel-size 2 --no-overlap-p2p-communication"
  "pp4-interleaved-no-overlap-p2p|4|--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 --no-overlap-p2p-communication|LAYERS=8"
  "pp2-dp2-distributed-optimizer-tied|4|--pipeline-model-parallel-size 2 --use-distributed-optimizer|TIED=1"
  "pp4-interleaved-tied|4|--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1|LAYERS=8 TIED=1"
  "pp2-ep2-alltoall|4|--pipeline-model-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
  "tp2-pp2|4|--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
  "tp2-sp-pp2-dp2-distributed-optimizer|8|--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --use-distributed-optimizer"
  "tp2-sp-pp2-tied|4|--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2|TIED=1"
  # Reductions and all-gathers overlapped with backward and forward, several buckets
  # (the model has about 40k parameters).
  "dp2-overlap|2|--overlap-grad-reduce --ddp-bucket-size 3000"
  "dp2-distributed-optimizer-overlap|2|--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 3000"
  "tp2-sp-dp2-distributed-optimizer-overlap|4|--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 3000"
  "dp2-ep2-distributed-optimizer-overlap|4|--expert-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 2000"
  "pp2-interleaved-dp2-distributed-optimizer-overlap-tied|4|--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 3000|LAYERS=8 TIED=1"
  # Router options (issue 5): seq_aux_loss under TP + SP (sequences split over ranks),
  # global_aux_loss (+ z-loss) over DP2 x 2 micro-batches against one rank with
  # the same global micro-batches (micro-batch 4), expert bias updated from counts over
  # DP x EP, and a DeepSeek-V3-style router with a shared expert under TP + SP x EP.
  "tp2-sp-seq-aux|2|--tensor-model-parallel-size 2 --sequence-parallel|ROUTER=seqaux"
  "tp2-seq-aux|2|--tensor-model-parallel-size 2|ROUTER=seqaux"
  "dp2-global-aux|2||ROUTER=global|ROUTER=global MBS=4"
  "dp2-ep2-expert-bias|4|--expert-model-parallel-size 2|ROUTER=bias"
  "tp2-sp-ep2-etp1-v3-router|2|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1|ROUTER=v3"
  # Token dropping under EP2 (capacity per rank's micro-batch, so no TP: the ranks' rows are
  # the reference's micro-batches): dropped copies are exchanged with no rank; with padding
  # every expert's input is capacity x 2 rows.
  "ep2-alltoall-capacity|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|ROUTER=capacity"
  "ep2-allgather-capacity|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather|ROUTER=capacity"
  "ep2-alltoall-capacity-pad|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|ROUTER=capacity-pad"
  "ep2-allgather-capacity-pad|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather|ROUTER=capacity-pad"
  # The all-to-all's chunks pulled straight into their expert groups and back
  # (MEGATON_MOE_ALLTOALL_EXCHANGE=pull), beside the overlapped DP reductions, and with
  # dropped copies.
  "dp2-ep2-alltoall-pull|4|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 2000|A2A=pull"
  "ep2-alltoall-capacity-pull|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|ROUTER=capacity A2A=pull"
  # --moe-shared-expert-overlap: the shared expert's halves beside the asynchronous
  # exchanges (all-to-all and pull), gated and under TP + SP.
  "ep2-shared-expert-overlap-gate|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --moe-shared-expert-overlap|ROUTER=gate"
  "ep2-shared-expert-overlap-pull|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --moe-shared-expert-overlap|ROUTER=gate A2A=pull"
  # --overlap-moe-expert-parallel-comm: two chunks per MoE layer, each one's exchanges
  # beside the other's experts (the shared expert beside the exposed ones).
  "ep2-ep-overlap-gate|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --overlap-moe-expert-parallel-comm|ROUTER=gate"
  "tp2-sp-ep2-ep-overlap-v3|2|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep --overlap-moe-expert-parallel-comm|ROUTER=v3"
  "dp2-ep2-ep-overlap|4|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 2000 --overlap-moe-expert-parallel-comm"
  # --moe-token-dispatcher-type flex: the all-to-all dispatcher with its fastest exchange.
  "ep2-flex-shared-expert-overlap|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep --moe-shared-expert-overlap|ROUTER=gate"
  "tp2-sp-ep2-shared-expert-overlap-v3|2|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall --moe-shared-expert-overlap|ROUTER=v3"
  # The sigmoid-gated shared expert: its gate weight is fed by each rank's sequence shard
  # under SP (gradient summed over TP) and by every row without it.
  "tp2-sp-shared-gate|2|--tensor-model-parallel-size 2 --sequence-parallel|ROUTER=gate"
  "tp2-shared-gate|2|--tensor-model-parallel-size 2|ROUTER=gate"
  # --qk-layernorm: the q/k norm weights are replicated over TP, each rank normalising its
  # own heads, so their gradients are summed over TP with and without sequence parallelism.
  "tp2-qk-layernorm|2|--tensor-model-parallel-size 2|QKN=1"
  "tp2-sp-qk-layernorm|2|--tensor-model-parallel-size 2 --sequence-parallel|QKN=1"
  "pp2-qk-layernorm|2|--pipeline-model-parallel-size 2|QKN=1"
  # FP8 (issue 16): the amaxes of TP-sharded operands are reduced over TP, so each TP rank
  # quantizes as the one-rank run does. TP's fp32 sums in another order (1e-9 relative)
  # can move a value across an FP8 rounding midpoint (one e4m3 step is 6-12%): a few such
  # flips put the delayed runs 1e-3 apart from one rank after 3 steps (measured 8.8e-4 on
  # the expert weights), hence their RTOL; a missing amax reduction changes every scale
  # and exceeds it. per-tensor current scaling keeps no state, so DP,
  # EP and PP see the same scales too. The delayed recipe's history follows the sequence of
  # micro-batches, which TP and PP keep and DP does not (as in Transformer Engine).
  "tp2-fp8-tensorwise|2|--tensor-model-parallel-size 2|FP8=tensorwise"
  "tp2-sp-fp8-tensorwise|2|--tensor-model-parallel-size 2 --sequence-parallel|FP8=tensorwise"
  "tp2-sp-fp8-delayed|2|--tensor-model-parallel-size 2 --sequence-parallel|FP8=delayed RTOL=2e-3"
  "dp2-distributed-optimizer-fp8-tensorwise|2|--use-distributed-optimizer|FP8=tensorwise"
  # FSDP: the FP8 layers cast weights gathered per layer, twice per micro-batch. (The
  # delayed recipe is not compared at DP: its history follows each rank's micro-batches.)
  "fsdp-dp2-fp8-tensorwise|2|--use-megatron-fsdp|FP8=tensorwise"
  # The experts' FP8 GEMMs: one quantizer per expert and operand, each expert's rows
  # padded to 16 (128 blockwise); with the default ETP = TP the experts' sharded operands
  # reduce their amaxes over ETP (the tp2 layouts above). With DP 1 (TP2 + SP, EP2, ETP1)
  # each expert gets the one-rank run's rows in its order: equal to one rank.
  "tp2-sp-ep2-etp1-fp8-tensorwise|2|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall|FP8=tensorwise"
  "tp2-sp-ep2-etp1-allgather-fp8-tensorwise|2|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type allgather|FP8=tensorwise"
  "tp2-sp-ep2-etp1-fp8-delayed|2|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall|FP8=delayed RTOL=1e-4"
  # With DP 2 an expert quantizes the copies of both ranks' micro-batches at once (its
  # amax and scale are the union's), which no one-rank run does: as in Transformer Engine,
  # the numbers differ by FP8 rounding (measured: parameters 2e-2 relative after 3 steps),
  # so this checks the run against one rank at rtol 5e-2, which a misrouted token, a wrong
  # expert's weight or a missing amax reduction exceeds.
  "ep2-alltoall-fp8-tensorwise-capacity-pad|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|FP8=tensorwise ROUTER=capacity-pad RTOL=5e-2"
  # --fp8-param-gather: each rank quantizes its shard of the FP8 weights from the fp32 main
  # params with the whole weight's scale (amax reduced over DP and TP) and all-gathers the
  # bytes; on CPU ranks that equals quantizing the fp32 weight at each use (one rank).
  "dp2-distributed-optimizer-fp8-param-gather|2|--use-distributed-optimizer --fp8-param-gather|FP8=tensorwise"
  "tp2-dp2-distributed-optimizer-fp8-param-gather|4|--tensor-model-parallel-size 2 --use-distributed-optimizer --fp8-param-gather|FP8=tensorwise"
  "pp2-fp8-delayed|2|--pipeline-model-parallel-size 2|FP8=delayed"
  # Context parallelism (a dense model: FP8 experts under CP are refused): every input's and
  # output gradient's amax maxed over the CP ranks (each holds part of the one-rank run's
  # tokens), with TP's feature splits over TP x CP; without the CP maximum cp2 differs from
  # one rank by 1.9e-2 (params). The delayed recipe is not compared: under CP the output gradients
  # carry Megatron's factor cp (the loss is each rank's token mean, the gradients then
  # averaged over CP), and its first quantization of each gradient uses scale 1, not an
  # amax-derived one that would absorb the factor, so a CP run drifts from one rank (params
  # 1.5e-2 after 3 steps) as it would in Megatron.
  "cp2-dense-fp8-tensorwise|2|--context-parallel-size 2|FP8=tensorwise DENSE=1"
  # With TP too, TP's fp32 partial sums move a few E5M2 gradient roundings (a 25% step each)
  # off the one-rank run's: params within 1.8e-3 (without the CP maximum 1.5e-2).
  "cp2-tp2-sp-dense-fp8-tensorwise|4|--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel|FP8=tensorwise DENSE=1 RTOL=5e-3"
  # The precision-aware optimizer's bf16 moments: each element's update depends on its own
  # moments only, so sharding them (or not) over DP, TP and EP gives one rank's values.
  # TP's fp32 sums in another order (1e-9 relative) can move a moment across a bf16
  # rounding midpoint (one bf16 step is 0.4-0.8%): measured 1.2e-5 on one expert weight
  # after 3 steps, hence RTOL 5e-5 there.
  "dp2-bf16-states|2||PAO=1"
  "dp2-distributed-optimizer-bf16-states|2|--use-distributed-optimizer|PAO=1"
  "tp2-sp-ep2-distributed-optimizer-bf16-states|4|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --use-distributed-optimizer --moe-token-dispatcher-type alltoall|PAO=1 RTOL=5e-5"
  # fp16 and fp8 moments: one scale per model parameter (its absmax reduced over the DP
  # shards and the TP slices), so every layout stores what one rank stores. As with bf16
  # states, the layouts' fp32 sums in another order (1e-9 relative) move a few stochastic
  # roundings; one fp8 step is 6-12% of a moment, so fp8 runs part from one rank by up to
  # 8.1e-5 (TP2, measured after 3 steps), hence RTOL 2e-4 there. Without the TP reduction
  # tp2-sp-fp8 parts by 1.1e-1; the DP reduction's effect is below this noise, and
  # tests/optim/test_scaled_states_mpi.cpp checks it bit for bit instead.
  "dp2-distributed-optimizer-fp16-states|2|--use-distributed-optimizer|PAO=fp16"
  "dp2-distributed-optimizer-fp8-states|2|--use-distributed-optimizer|PAO=fp8 RTOL=2e-4"
  "tp2-sp-fp16-states|2|--tensor-model-parallel-size 2 --sequence-parallel|PAO=fp16 RTOL=5e-5"
  "tp2-sp-fp8-states|2|--tensor-model-parallel-size 2 --sequence-parallel|PAO=fp8 RTOL=2e-4"
  # Activation recomputation (issue 18): the re-run forwards repeat the layouts'
  # collectives (TP/SP gathers, the EP all-to-all) and replay the kept routing; a
  # pipeline stage keeps each in-flight micro-batch's recompute inputs.
  "dp2-distributed-optimizer-recompute-full|2|--use-distributed-optimizer|RC=full"
  "tp2-sp-recompute-selective-v3|2|--tensor-model-parallel-size 2 --sequence-parallel|RC=sel ROUTER=v3"
  "tp2-sp-ep2-etp1-recompute-full|2|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall|RC=full"
  "ep2-alltoall-capacity-recompute-selective|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|RC=sel ROUTER=capacity"
  "pp2-interleaved-recompute-block|2|--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2|LAYERS=8 RC=block"
  # fp16 loss scaling (issue 18): every stage's backward starts from the scaled loss (and
  # the aux losses' gradients carry the scale), the optimizer unscales the reduced grads.
  "dp2-distributed-optimizer-fp16|2|--use-distributed-optimizer|FP16=1"
  "tp2-sp-fp16|2|--tensor-model-parallel-size 2 --sequence-parallel|FP16=1"
  "ep2-alltoall-fp16|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|FP16=1"
  "pp2-interleaved-fp16|2|--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2|LAYERS=8 FP16=1"
  # BF16 main grads (issue 18): each micro-batch's gradient rounded into bf16 grad
  # buffers, reduced over DP (and SP's norm grads over TP) as bf16 tensors. A layout moves
  # the rounding points (each DP rank rounds its own micro-batches, then the bf16 sum is
  # rounded), so the runs differ from one rank by bf16 noise: measured after 3 steps,
  # params 5.2e-4 (DP2, EP2), 1.6e-4 (TP2+SP), grad norm 4.8e-5, zero counts up to 74
  # elements of 1408 (two bf16 partial sums cancelling exactly); hence RTOL 2e-3 and
  # ZATOL 100. That checks the reductions (a gradient missing or summed twice is far
  # outside), not the rounding, which tests/model/test_bf16_main_grads.cpp checks bit for
  # bit. The pipeline keeps one rank's accumulation order: PP2 is compared at 1e-5.
  "dp2-bf16-main-grads|2||MG=bf16 RTOL=2e-3 ZATOL=100"
  "dp2-distributed-optimizer-bf16-main-grads|2|--use-distributed-optimizer|MG=bf16 RTOL=2e-3 ZATOL=100"
  "tp2-sp-grad-reduce-in-bf16|2|--tensor-model-parallel-size 2 --sequence-parallel|MG=reduce RTOL=2e-3 ZATOL=100"
  "ep2-alltoall-bf16-main-grads|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|MG=bf16 RTOL=2e-3 ZATOL=100"
  # FSDP's gradients accumulated and reduce-scattered in bf16 into fp32 shards
  # (--megatron-fsdp-grad-comm-dtype bf16): bf16 noise against the fp32 one-rank run.
  "fsdp-dp2-bf16-grad-comm|2|--use-megatron-fsdp --megatron-fsdp-grad-comm-dtype bf16|RTOL=3e-3 ZATOL=150"
  "pp2-interleaved-bf16-main-grads|2|--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2|LAYERS=8 MG=bf16"
  # Tied embeddings: each stage rounds its part (lookup, output layer), their bf16 sum is
  # rounded again, where one rank rounds after each.
  "pp2-tied-bf16-main-grads|2|--pipeline-model-parallel-size 2|TIED=1 MG=bf16 RTOL=2e-3 ZATOL=100"
  # Optimizer offloading (issue 18): a rank's first half of its AdamW elements (its shard's
  # pieces under the distributed optimizer) updated from host buffers; checkpoints gather
  # host main params and moments.
  "dp2-distributed-optimizer-offload|2|--use-distributed-optimizer|OFF=1"
  "tp2-sp-ep2-offload|4|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|OFF=1"
  # --eod-mask-loss (issue 19): a vocabulary of 7 tokens + eod (8 rows under TP 1 and 2), so
  # about one input in 8 is eod and each micro-batch leaves out a different number of tokens.
  # Each DP rank and the last pipeline stage count their micro-batches' tokens; the logged
  # loss is the global masked sum over the global count, the gradient the mean over
  # micro-batches of each one's masked token mean, as on one rank.
  "dp2-eod-mask-loss|2||EOD=1 VOCAB=7 PAD=4"
  "pp2-eod-mask-loss|2|--pipeline-model-parallel-size 2|EOD=1 VOCAB=7 PAD=4"
  "pp2-dp2-eod-mask-loss|4|--pipeline-model-parallel-size 2|EOD=1 VOCAB=7 PAD=4"
  "tp2-sp-eod-mask-loss|2|--tensor-model-parallel-size 2 --sequence-parallel|EOD=1 VOCAB=7 PAD=4"
  # --calculate-per-token-loss (issue 20): each rank's gradients are of its summed losses,
  # summed over DP and divided by the step's loss tokens over the DP ranks (counted on the
  # last stage under PP); with the eod mask the micro-batches' counts differ, so a per-rank
  # or per-micro-batch division would not match one rank. The aux losses' gradients (EP2)
  # carry the micro-batch's tokens; FP16 scales the summed losses by the loss scale.
  "dp2-distributed-optimizer-per-token-eod|2|--use-distributed-optimizer|PTL=1 EOD=1 VOCAB=7 PAD=4"
  "pp2-per-token-eod|2|--pipeline-model-parallel-size 2|PTL=1 EOD=1 VOCAB=7 PAD=4"
  "pp2-interleaved-per-token-eod|2|--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2|LAYERS=8 PTL=1 EOD=1 VOCAB=7 PAD=4"
  "tp2-sp-per-token-eod|2|--tensor-model-parallel-size 2 --sequence-parallel|PTL=1 EOD=1 VOCAB=7 PAD=4"
  "ep2-alltoall-per-token|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|PTL=1"
  "dp2-per-token-fp16|2||PTL=1 FP16=1"
  # Batch-size schedules (issue 19): each step's micro-batches split over the DP ranks
  # (1 then 2 per rank), the pipeline's micro-batch count changing between steps.
  "dp2-rampup|2||BS=ramp"
  "dp2-distributed-optimizer-step-schedule|2|--use-distributed-optimizer|BS=step"
  "pp2-rampup|2|--pipeline-model-parallel-size 2|BS=ramp"
  "pp2-interleaved-step-schedule|2|--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2|LAYERS=8 BS=step"
  "ep2-alltoall-rampup|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|BS=ramp"
  "tp2-sp-step-schedule|2|--tensor-model-parallel-size 2 --sequence-parallel|BS=step"
  # Multi-latent attention (issue 20): heads split over TP (k_pe gathered under SP and its
  # gradient reduce-scattered, all-reduced without SP; the replicated down projections'
  # and latent norms' gradients summed over TP only under SP), pipeline stages, experts.
  "mla-tp2-sp|2|--tensor-model-parallel-size 2 --sequence-parallel|MLA=1"
  "mla-tp2|2|--tensor-model-parallel-size 2|MLA=1"
  "mla-pp2|2|--pipeline-model-parallel-size 2|MLA=1"
  "mla-ep2-v3-router|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|MLA=1 ROUTER=v3"
  "mla-dp2-distributed-optimizer|2|--use-distributed-optimizer|MLA=1"
  "mla-tp2-sp-recompute|2|--tensor-model-parallel-size 2 --sequence-parallel|MLA=1 RC=sel"
  # Multi-token prediction (issue 20): the depths on the last stage with their copy of the
  # (untied) embeddings, whose gradient is summed with the first stage's; TP/SP, EP, DP.
  "mtp-pp2|2|--pipeline-model-parallel-size 2|MTP=2"
  "mtp-pp2-tied|2|--pipeline-model-parallel-size 2|MTP=1 TIED=1"
  "mtp-pp2-interleaved|2|--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2|MTP=1 LAYERS=8"
  "mtp-tp2-sp|2|--tensor-model-parallel-size 2 --sequence-parallel|MTP=2"
  "mtp-ep2|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|MTP=1 ROUTER=v3"
  "mtp-dp2-distributed-optimizer|2|--use-distributed-optimizer|MTP=1"
  "mtp-pp2-per-token-eod|2|--pipeline-model-parallel-size 2|MTP=1 PTL=1 EOD=1 VOCAB=7 PAD=4"
  "mtp-dp2-eod|2||MTP=1 EOD=1 VOCAB=7 PAD=4"
  "mla-mtp-tp2-sp-pp2|4|--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2|MLA=1 MTP=1"
  # Packed documents (issue 20): a vocabulary of 7 tokens + eod, so that about one input in 8
  # ends a document and every micro-batch packs different ones. Each rank packs its own
  # micro-batches (DP, EP), the stages that read no tokens pack them from the samples (PP),
  # every TP rank attends over all B x S rows of its heads (TP + SP); with the eod mask and
  # per-token loss, under selective recompute (core_attn), and with MLA.
  "dp2-packed|2||PACK=1 VOCAB=7 PAD=4"
  "tp2-sp-packed|2|--tensor-model-parallel-size 2 --sequence-parallel|PACK=1 VOCAB=7 PAD=4"
  "pp2-packed|2|--pipeline-model-parallel-size 2|PACK=1 VOCAB=7 PAD=4"
  "ep2-alltoall-packed|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|PACK=1 VOCAB=7 PAD=4"
  "tp2-sp-packed-qk-layernorm-recompute|2|--tensor-model-parallel-size 2 --sequence-parallel|PACK=1 QKN=1 RC=sel VOCAB=7 PAD=4"
  "pp2-packed-per-token-eod|2|--pipeline-model-parallel-size 2|PACK=1 PTL=1 EOD=1 VOCAB=7 PAD=4"
  "mla-tp2-sp-packed|2|--tensor-model-parallel-size 2 --sequence-parallel|MLA=1 PACK=1 VOCAB=7 PAD=4"
  "mla-pp2-packed|2|--pipeline-model-parallel-size 2|MLA=1 PACK=1 VOCAB=7 PAD=4"
  # MTP depths shift within each document; learned positions read the restarted ids.
  "mtp-pp2-packed|2|--pipeline-model-parallel-size 2|MTP=1 PACK=1 VOCAB=7 PAD=4"
  "mtp-tp2-sp-packed|2|--tensor-model-parallel-size 2 --sequence-parallel|MTP=2 PACK=1 VOCAB=7 PAD=4"
  # Context parallelism over packed documents: each comm type cuts its blocks at the
  # documents' boundaries (documents cross chunks and ranks at this vocabulary).
  "cp2-p2p-packed|2|--context-parallel-size 2 --cp-comm-type p2p|PACK=1 VOCAB=7 PAD=4"
  "cp2-all-gather-packed|2|--context-parallel-size 2 --cp-comm-type all_gather|PACK=1 VOCAB=7 PAD=4"
  "cp2-a2a-packed|2|--context-parallel-size 2 --cp-comm-type a2a|PACK=1 VOCAB=7 PAD=4"
  "cp4-p2p-packed|4|--context-parallel-size 4|PACK=1 VOCAB=7 PAD=4"
  "cp2-tp2-sp-packed|4|--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel|PACK=1 VOCAB=7 PAD=4"
  # --eod-mask-loss under CP: the weights count the whole micro-batch's unmasked tokens
  # (with Megatron's per-rank count cp2 differs from one rank by 2e-2 in the params).
  "cp2-eod|2|--context-parallel-size 2|EOD=1 VOCAB=7 PAD=4"
  "cp2-pp2-eod|4|--context-parallel-size 2 --pipeline-model-parallel-size 2|EOD=1 VOCAB=7 PAD=4"
  # Multi-token prediction under CP: each depth shifts the whole samples (gathered over CP)
  # and weighs by the whole micro-batch's token counts.
  "cp2-mtp|2|--context-parallel-size 2|MTP=1"
  "cp4-mtp2|4|--context-parallel-size 4 --cp-comm-type all_gather|MTP=2"
  "cp2-tp2-sp-mtp2-eod|4|--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel|MTP=2 EOD=1 VOCAB=7 PAD=4"
  "cp2-mtp-packed|2|--context-parallel-size 2|MTP=1 PACK=1 VOCAB=7 PAD=4"
  "cp2-pp2-mtp-eod|4|--context-parallel-size 2 --pipeline-model-parallel-size 2|MTP=1 EOD=1 VOCAB=7 PAD=4"
  "learned-tp2-sp-packed|2|--tensor-model-parallel-size 2 --sequence-parallel|POS=learned_absolute PACK=1 VOCAB=7 PAD=4"
  "learned-pp2-packed|2|--pipeline-model-parallel-size 2|POS=learned_absolute PACK=1 VOCAB=7 PAD=4"
  # Hybrid models (issue 23): Mamba-2 layers with attention, MLP and MoE layers. TP splits
  # the Mamba heads and groups (in_proj's z, x, B, C, dt blocks, the conv's x, B, C); SP
  # gathers the rows before in_proj; PP cuts the pattern evenly or at its '|'; EP and the
  # distributed optimizer see the E layers and the Mamba parameters as any others.
  "hyb-tp2-sp|2|--tensor-model-parallel-size 2 --sequence-parallel|HYB=M-MA-ME"
  "hyb-pp2|2|--pipeline-model-parallel-size 2|HYB=M-MAM-ME"
  "hyb-pp2-segments|2|--pipeline-model-parallel-size 2|HYB=M-MA-PME"
  "hyb-ep2|2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|HYB=M-MA-ME"
  "hyb-dp2-distributed-optimizer|2|--use-distributed-optimizer|HYB=M-MA-ME"
  "hyb-tp2-sp-ep2-distopt|4|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --use-distributed-optimizer|HYB=M-MA-ME"
  # Packed documents: the scan and the convolution restart at each document.
  "hyb-tp2-sp-packed|2|--tensor-model-parallel-size 2 --sequence-parallel|HYB=M-MA-ME PACK=1 VOCAB=7 PAD=4"
  "hyb-dp2-recompute-full|2|--use-distributed-optimizer|HYB=M-MA-ME RC=full"
  "hyb-pp2-vpp2|2|--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2|HYB=M-MAM-ME"
  "hyb-fsdp-optim-grads-params-dp2|2|--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params|HYB=M-MA-ME"
  # FP8: in_proj's and out_proj's GEMMs too, their TP-split operands' amaxes over TP.
  "hyb-tp2-sp-fp8-tensorwise|2|--tensor-model-parallel-size 2 --sequence-parallel|HYB=M-MA-ME FP8=tensorwise MHD=2"
)
# name | ranks, flags of the first two steps | ranks, flags of the third | model variant
resumes=(
  # A hybrid model's Mamba parameters resharded (in_proj's blocks) on load.
  "hyb-tp2-sp-to-pp2-dp1|2|--tensor-model-parallel-size 2 --sequence-parallel|2|--pipeline-model-parallel-size 2|HYB=M-MAM-ME"
  "hyb-one-rank-to-tp2-sp-distopt|1||4|--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer|HYB=M-MA-ME"
  "dp2-distopt-to-one-rank|2|--use-distributed-optimizer|1|"
  "one-rank-to-dp4-distopt|1||4|--use-distributed-optimizer"
  "ep2-etp2-to-one-rank|4|--expert-model-parallel-size 2 --expert-tensor-parallel-size 2|1|"
  "one-rank-to-dp2-ep2-distopt|1||4|--expert-model-parallel-size 2 --use-distributed-optimizer"
  # The distributed optimizer reads only its shard of each moment, by offset: across the
  # TP slice's SwiGLU boxes, and in fp8 with the scales.
  "tp2-sp-to-tp2-dp2-distopt|2|--tensor-model-parallel-size 2 --sequence-parallel|4|--tensor-model-parallel-size 2 --use-distributed-optimizer"
  "one-rank-to-dp2-distopt-fp8-states|1||2|--use-distributed-optimizer|PAO=fp8 RTOL=2e-4"
  # FSDP: each rank writes its shards; a load writes the whole weights, then keeps its shard.
  "fsdp-dp2-to-one-rank|2|--use-megatron-fsdp|1|"
  "one-rank-to-fsdp-dp2-ep2|1||4|--use-megatron-fsdp --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
  "fsdp-optim-grads-dp4-to-fsdp-tp2-sp-dp2|4|--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads|4|--use-megatron-fsdp --tensor-model-parallel-size 2 --sequence-parallel"
  # Context parallelism: the CP ranks hold the same parameters (written once).
  "cp2-to-one-rank|2|--context-parallel-size 2|1|"
  # The router's expert bias is replicated over DP x CP: written once.
  "cp2-ep2-expert-bias-to-one-rank|2|--context-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|1||ROUTER=bias"
  "one-rank-to-cp2-tp2-sp|1||4|--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel"
  "cp2-dp2-distopt-to-cp4-a2a|4|--context-parallel-size 2 --use-distributed-optimizer|4|--context-parallel-size 4 --cp-comm-type a2a"
  # fp32 moments converted into bf16 on load, piece by piece (read by range); fp8 below.
  "one-rank-to-dp2-distopt-into-bf16-states|1||2|--use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16|RTOL=1e-4"
  "tp2-sp-ep2-to-ep4|2|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1|4|--expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall"
  "pp2-distopt-to-dp2|2|--pipeline-model-parallel-size 2 --use-distributed-optimizer|2|"
  "dp2-to-pp4|2||4|--pipeline-model-parallel-size 4"
  "pp2-distopt-to-one-rank-tied|2|--pipeline-model-parallel-size 2 --use-distributed-optimizer|1||TIED=1"
  "pp2-dp2-to-tp2-sp-pp2-tied|4|--pipeline-model-parallel-size 2|4|--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2|TIED=1"
  # The expert bias (fp32, not a parameter) goes through the checkpoint.
  "dp2-ep2-expert-bias-to-one-rank|4|--expert-model-parallel-size 2|1||ROUTER=bias"
  # The replicated q/k norm weights are written once and loaded whole on every TP rank.
  "tp2-sp-to-one-rank-qk-layernorm|2|--tensor-model-parallel-size 2 --sequence-parallel|1||QKN=1"
  "one-rank-to-tp2-qk-layernorm|1||2|--tensor-model-parallel-size 2|QKN=1"
  # The delayed recipe's amax histories and scales go through the checkpoint.
  "tp2-pp2-fp8-delayed-to-one-rank|4|--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2|1||FP8=delayed RTOL=2e-3"
  "dp2-fp8-param-gather-to-one-rank|2|--use-distributed-optimizer --fp8-param-gather|1|--use-distributed-optimizer --fp8-param-gather|FP8=tensorwise"
  # The experts' amax histories: each expert-parallel rank writes its own experts'.
  # (DP 1: the delayed history follows the micro-batches, which DP splits.)
  # bf16 moments through the checkpoint (assembled over the DP shards, written in bf16).
  "dp2-distopt-to-one-rank-bf16-states|2|--use-distributed-optimizer|1||PAO=1"
  # fp16 and fp8 moments with their scales (one per parameter, written by DP rank 0).
  "dp2-distopt-to-one-rank-fp16-states|2|--use-distributed-optimizer|1||PAO=fp16"
  "dp2-distopt-to-one-rank-fp8-states|2|--use-distributed-optimizer|1||PAO=fp8 RTOL=2e-4"
  "tp2-sp-to-one-rank-fp8-states|2|--tensor-model-parallel-size 2 --sequence-parallel|1||PAO=fp8 RTOL=2e-4"
  # The dynamic loss scaler's scale and trackers go through the checkpoint.
  "dp2-distopt-to-one-rank-fp16|2|--use-distributed-optimizer|1||FP16=1"
  "dp2-distopt-to-one-rank-offload|2|--use-distributed-optimizer|1||OFF=1"
  # Mid-ramp: the third step (batch 8) on another layout, from the schedule's samples.
  "dp2-rampup-to-pp2|2||2|--pipeline-model-parallel-size 2|BS=ramp"
  "one-rank-step-schedule-to-ep2|1||2|--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall|BS=step"
  # MLA's replicated down projections and latent norms are written once, loaded whole.
  # MTP depths and the expert bias of their router go through the checkpoint.
  "mtp-pp2-to-tp2-sp|2|--pipeline-model-parallel-size 2|2|--tensor-model-parallel-size 2 --sequence-parallel|MTP=1 ROUTER=v3"
  "mla-tp2-sp-to-pp2|2|--tensor-model-parallel-size 2 --sequence-parallel|2|--pipeline-model-parallel-size 2|MLA=1"
  "tp2-sp-ep2-etp1-fp8-delayed-to-one-rank|2|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall|1||FP8=delayed RTOL=1e-3"
)
compare_layouts
compare_resumes
# The resume matrix (issue 21): nine layouts of the 8-layer model each save after two steps
# and load under three others for the third, which must equal the one-rank run's third
# step; every layout is also a destination, and DP2 + distributed optimizer, PP2
# interleaved and EP2 x TP2 load each other both ways. One save per source, three loads.
matrix_layouts=(
  "one-rank|1|"
  "dp2-distopt|2|--use-distributed-optimizer"
  "pp2-interleaved|2|--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2"
  "ep2-tp2-sp|4|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
  "tp2-sp|2|--tensor-model-parallel-size 2 --sequence-parallel"
  "pp4|4|--pipeline-model-parallel-size 4"
  "dp2-ep2-distopt|4|--expert-model-parallel-size 2 --use-distributed-optimizer"
  "pp2-dp2-distopt|4|--pipeline-model-parallel-size 2 --use-distributed-optimizer"
  "tp2-ep2-etp1|2|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall"
)
# source: its three destinations
matrix_loads=(
  "one-rank:dp2-distopt pp2-interleaved ep2-tp2-sp"
  "dp2-distopt:pp2-interleaved ep2-tp2-sp pp4"
  "pp2-interleaved:dp2-distopt ep2-tp2-sp tp2-sp"
  "ep2-tp2-sp:dp2-distopt pp2-interleaved one-rank"
  "tp2-sp:pp2-dp2-distopt dp2-ep2-distopt tp2-ep2-etp1"
  "pp4:tp2-sp one-rank dp2-ep2-distopt"
  "dp2-ep2-distopt:pp4 tp2-ep2-etp1 pp2-interleaved"
  "pp2-dp2-distopt:ep2-tp2-sp one-rank tp2-sp"
  "tp2-ep2-etp1:dp2-distopt pp2-dp2-distopt pp4"
)
declare -A matrix_np matrix_flags
for entry in "${matrix_layouts[@]}"; do
  IFS='|' read -r name np flags <<<"$entry"
  matrix_np[$name]=$np
  matrix_flags[$name]=$flags
done
if [[ -z "${LAYOUTS_ONLY:-}" || matrix =~ $LAYOUTS_ONLY ]]; then
  use_variant "LAYERS=8"
  if reference_of "LAYERS=8"; then
    for entry in "${matrix_loads[@]}"; do
      src=${entry%%:*}
      # shellcheck disable=SC2086
      ITERS=2 run "matrix-$src" "${matrix_np[$src]}" ${matrix_flags[$src]} || { status=1; continue; }
      for dst in ${entry#*:}; do
        name="matrix-$src-to-$dst"
        # shellcheck disable=SC2086
        run "$name" "${matrix_np[$dst]}" --load "$dir/matrix-$src/save" ${matrix_flags[$dst]} ||
          { status=1; continue; }
        if out=$(python3 "$compare" --resumed --rtol "$RTOL" --num-zeros-atol "$ZATOL" "$dir/$reference" "$dir/$name"); then
          echo "ok: resume $name: $out"
        else
          echo "FAILED: resume $name differs from one rank:"; echo "$out"; status=1
        fi
      done
    done
  else
    status=1
  fi
fi
# A vocabulary whose padding changes with the TP size (100 tokens + eod, Megatron's default
# --make-vocab-size-divisible-by 128: 128 rows under TP 1, 256 under TP 2). A TP1
# checkpoint passes through another layout without training (loaded, padded to 256 rows,
# saved) and comes back (trimmed to 128 rows): the third step then equals the one-rank run's.
vocab_hops=(
  "vocab-tp1-tp2-tp1|2|--tensor-model-parallel-size 2"
  "vocab-tp1-tp2-pp2-tp1|4|--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
  "vocab-tp1-tp2-sp-ep2-tp1|4|--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
  "vocab-tp1-tp2-dp2-distopt-tp1|4|--tensor-model-parallel-size 2 --use-distributed-optimizer"
)
vocab_hop() {  # NAME NP "FLAGS"
  local name=$1
  [ -e "$dir/vocab-first" ] || ITERS=2 run vocab-first 1 || return 1
  # shellcheck disable=SC2086
  ITERS=2 run "$name-hop" "$2" --load "$dir/vocab-first/save" $3 || return 1
  run "$name" 1 --load "$dir/$name-hop/save" || return 1
  if out=$(python3 "$compare" --resumed "$dir/$reference" "$dir/$name"); then
    echo "ok: resume $name: $out"
  else
    echo "FAILED: resume $name differs from one rank:"; echo "$out"; return 1
  fi
}
for entry in "${vocab_hops[@]}"; do
  IFS='|' read -r name np flags <<<"$entry"
  [[ -z "${LAYOUTS_ONLY:-}" || $name =~ $LAYOUTS_ONLY ]] || continue
  use_variant "VOCAB=100 PAD=128"
  reference_of "VOCAB=100 PAD=128" || { status=1; continue; }
  vocab_hop "$name" "$np" "$flags" || status=1
done
# Training on the padded rows: TP2's step from the TP1 checkpoint (padded to 256 rows)
# equals one rank's step from it with --make-vocab-size-divisible-by 256 (the same rows).
if [[ -z "${LAYOUTS_ONLY:-}" || vocab-tp1-to-tp2-step =~ $LAYOUTS_ONLY ]]; then
  use_variant "VOCAB=100 PAD=128"
  if { [ -e "$dir/vocab-first" ] || ITERS=2 run vocab-first 1; } &&
     run vocab-tp1-to-tp2-step 2 --load "$dir/vocab-first/save" --tensor-model-parallel-size 2 &&
     use_variant "VOCAB=100 PAD=256" && run vocab-tp1-to-one-rank-pad256-step 1 --load "$dir/vocab-first/save"; then
    if out=$(python3 "$compare" --resumed "$dir/vocab-tp1-to-one-rank-pad256-step" "$dir/vocab-tp1-to-tp2-step"); then
      echo "ok: vocab-tp1-to-tp2-step equals one rank padded alike: $out"
    else
      echo "FAILED: vocab-tp1-to-tp2-step differs from one rank padded alike:"; echo "$out"; status=1
    fi
  else
    status=1
  fi
fi
# fp32 moments converted into fp8 on load (each scale from the whole parameter's absmax,
# then the distributed optimizer's pieces): the third step on DP2 with the distributed
# optimizer equals one rank converting alike (not the fp32 run: fp8 moments round).
if [[ -z "${LAYOUTS_ONLY:-}" || into-fp8-states =~ $LAYOUTS_ONLY ]]; then
  use_variant ""
  fp8_states=(--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8)
  if { [ -e "$dir/fp32-states-first" ] || ITERS=2 run fp32-states-first 1; } &&
     run into-fp8-states-dp2-distopt 2 --load "$dir/fp32-states-first/save" \
       --use-distributed-optimizer "${fp8_states[@]}" &&
     run into-fp8-states-one-rank 1 --load "$dir/fp32-states-first/save" "${fp8_states[@]}"; then
    if out=$(python3 "$compare" --resumed "$dir/into-fp8-states-one-rank" "$dir/into-fp8-states-dp2-distopt"); then
      echo "ok: into-fp8-states (DP2, distributed optimizer) equals one rank converting alike: $out"
    else
      echo "FAILED: into-fp8-states differs from one rank converting alike:"; echo "$out"; status=1
    fi
  else
    status=1
  fi
fi
exit $status
