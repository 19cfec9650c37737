"""Where TP2's step goes (issue 22; docs/performance.md "Communication overlap"): llama-1.3B
with --tensor-model-parallel-size 2 --sequence-parallel on 2 GPUs, global batch 16, without
and with --tp-comm-overlap, its chunk count (MEGATON_TP_COMM_OVERLAP_SPLITS), one hardware
queue (CUDA_DEVICE_MAX_CONNECTIONS=1), NCCL's CTA limit, the data-parallel flags of
bench/gpu_scaling.py, and (--profile) the op profiles of the first two.

Usage (repository root on the GPU machine; binary from tools/gpu_bundle.sh):
    python3 bench/tp_comm_overlap_bench.py --megaton BIN [--iters 30] [--profile]
Prints one line per variant (median step ms, tokens/s, peak GiB).
"""
import argparse, os, sys

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench import CONFIGS, run_megaton  # noqa: E402
from gpu_parallel import mpirun  # noqa: E402

TP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
DP_FLAGS = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
OVERLAP = ["--tp-comm-overlap"]
# name, environment, flags after TP
# megaton sets CUDA_DEVICE_MAX_CONNECTIONS=1 itself when --tp-comm-overlap is on its command
# line and the variable is unset; 8 (CUDA's default) gives the multi-queue form.
EIGHT = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
VARIANTS = [
    ("no overlap flag", {}, []),
    ("--tp-comm-overlap, 8 connections", EIGHT, OVERLAP),
    ("--tp-comm-overlap, 8 connections, 1 chunk",
     dict(EIGHT, MEGATON_TP_COMM_OVERLAP_SPLITS="1"), OVERLAP),
    ("--tp-comm-overlap, 8 connections, 4 chunks",
     dict(EIGHT, MEGATON_TP_COMM_OVERLAP_SPLITS="4"), OVERLAP),
    ("no overlap flag, CUDA_DEVICE_MAX_CONNECTIONS=1", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, []),
    ("--tp-comm-overlap (CUDA_DEVICE_MAX_CONNECTIONS=1)", {}, OVERLAP),
    ("no overlap flag, NCCL_MAX_CTAS=8", {"NCCL_MAX_CTAS": "8"}, []),
    ("--use-distributed-optimizer", {}, DP_FLAGS[:1]),
    ("gpu_scaling's data-parallel flags", {}, DP_FLAGS),
    ("gpu_scaling's data-parallel flags, --tp-comm-overlap", {}, DP_FLAGS + OVERLAP),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--megaton", required=True)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    c = CONFIGS["llama-1.3B"]
    variants = list(VARIANTS)
    if a.profile:
        variants += [(n + ", op profile", dict(e, MEGATON_OP_PROFILE="1"), f)
                     for n, e, f in VARIANTS[:2]]
    for name, env, flags in variants:
        saved = dict(os.environ)
        os.environ.update(env)
        launcher = mpirun(2)
        if "CUDA_DEVICE_MAX_CONNECTIONS" in env:  # mpirun forwards MEGATON_* and NCCL_* only
            launcher += ["-x", "CUDA_DEVICE_MAX_CONNECTIONS"]
        r = run_megaton(a.megaton, c, a.iters, launcher=launcher, extra=TP + flags, world=2,
                        dp=1, micro_batches=4)
        os.environ.clear()
        os.environ.update(saved)
        profile = r.pop("op_profile", None)
        print(f"{name}: {r}", flush=True)
        if profile:
            print(profile, flush=True)


if __name__ == "__main__":
    main()
