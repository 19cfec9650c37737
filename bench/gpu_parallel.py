"""Multi-GPU checks and scaling on one node (issue 4), in one run on the GPU machine.

Usage (from the repository root, binaries from tools/gpu_bundle.sh, data/ prepared):
    python3 bench/gpu_parallel.py --megaton BIN [--gpus 2] [--out FILE] [--skip-curves]

1. Loss curves: the demo config (configs/demo-moe.yaml, fortunes corpus) for 50
   iterations on one GPU, then under DP2 (with and without the distributed optimizer),
   TP2 (with and without SP), EP2 (both dispatchers) and PP2 (mpirun, one rank per GPU);
   each layout's lm loss per iteration against the one-GPU curve (relative difference;
   bf16 runs, so not bit-equal: summation order differs between layouts).
2. Scaling: moe-8x-top2 with EP2 (data parallel over the dense layers), llama-1.3B with
   DP2 + distributed optimizer and with TP2 (+ sequence parallel), against one GPU
   running the same micro-batch: tokens/s per GPU (the job's tokens/s over its GPUs) and
   scaling efficiency = tokens/s per GPU over the one-GPU run's tokens/s. DP and EP runs
   give each GPU its own micro-batch (global batch = micro-batch x 2); TP2 splits one
   micro-batch over both GPUs.
"""
import argparse, json, os, subprocess, sys, tempfile

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench import CONFIGS, run_megaton  # noqa: E402

def mpirun(n):
    """The launcher of an n-rank run; it hands every rank LD_LIBRARY_PATH and whatever
    MEGATON_* and NCCL_* variables are set (NCCL_NVLS_ENABLE=0, MEGATON_OP_PROFILE,
    MEGATON_MOE_DIRECT_ALLTOALL, MEGATON_COMM_TIMEOUT_S, ...)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off here
    forward = ["LD_LIBRARY_PATH"] + sorted(
        k for k in os.environ if k.startswith(("MEGATON_", "NCCL_")))
    return (["mpirun", "--allow-run-as-root", "-np", str(n), "--bind-to", "none"] +
            [arg for k in forward for arg in ("-x", k)])

def curve(binary, name, launcher, flags, work):
    metrics = os.path.join(work, name + ".jsonl")
    cmd = list(launcher) + [binary, "train", "--config", "configs/demo-moe.yaml",
                            "--device", "cuda", "--bf16", "--train-iters", "50",
                            "--eval-iters", "0", "--eval-interval", "0", "--save-interval", "0",
                            "--lr-warmup-iters", "5",
                            "--make-vocab-size-divisible-by", "64",
                            "--log-metrics-file", metrics] + list(flags)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return None, (out.stderr or out.stdout).strip().splitlines()[-1][:300]
    with open(metrics) as f:
        return [json.loads(l)["lm_loss"] for l in f if l.strip()], None

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--megaton", required=True)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default="")
    p.add_argument("--skip-curves", action="store_true")
    p.add_argument("--skip-scaling", action="store_true")
    p.add_argument("--only", default="",
                   help="comma-separated layout names to run (default: all), e.g. "
                        "'DP2 distopt overlap,EP2 allgather'")
    a = p.parse_args()
    lines = []
    only = {n.strip() for n in a.only.split(",") if n.strip()}
    wanted = lambda name: not only or name in only
    if not a.skip_curves:
        work = tempfile.mkdtemp()
        ref, err = curve(a.megaton, "one-gpu", [], [], work)
        lines += ["| layout | lm loss it 1 | it 50 | worst relative difference vs 1 GPU |",
                  "|---|---|---|---|"]
        if ref is None:
            lines.append(f"| 1 GPU | error: {err} | | |")
        else:
            lines.append(f"| 1 GPU | {ref[0]:.4f} | {ref[-1]:.4f} | |")
            overlap = ["--use-distributed-optimizer", "--overlap-grad-reduce",
                       "--overlap-param-gather"]
            for name, flags in [("DP2", []), ("DP2 distopt", ["--use-distributed-optimizer"]),
                                ("DP2 distopt overlap", overlap),
                                ("TP2", ["--tensor-model-parallel-size", "2"]),
                                ("TP2 SP", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                                ("EP2 alltoall", ["--expert-model-parallel-size", "2",
                                                  "--moe-token-dispatcher-type", "alltoall"]),
                                ("EP2 allgather", ["--expert-model-parallel-size", "2",
                                                   "--moe-token-dispatcher-type", "allgather"]),
                                ("PP2", ["--pipeline-model-parallel-size", "2"])]:
                if not wanted(name):
                    continue
                got, err = curve(a.megaton, name.replace(" ", "-"), mpirun(2), flags, work)
                if got is None:
                    lines.append(f"| {name} | error: {err} | | |")
                    continue
                worst = max(abs(x - y) / y for x, y in zip(got, ref)) if len(got) == len(ref) else float("nan")
                lines.append(f"| {name} | {got[0]:.4f} | {got[-1]:.4f} | {worst:.2e} |")
            print("\n".join(lines), flush=True)
    if not a.skip_scaling:
        rows = ["| config | layout | GPUs | step ms | tokens/s per GPU | scaling efficiency | peak GiB |",
                "|---|---|---|---|---|---|---|"]
        overlap = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
        plans = [("moe-8x-top2", [("EP2 (DP2 dense)", 2, 2, ["--expert-model-parallel-size", "2",
                                                           "--moe-token-dispatcher-type", "alltoall"]),
                                  ("EP2 (DP2 dense) distopt overlap", 2, 2,
                                   ["--expert-model-parallel-size", "2",
                                    "--moe-token-dispatcher-type", "alltoall"] + overlap)]),
                 ("llama-1.3B", [("DP2 distopt", 2, 2, ["--use-distributed-optimizer"]),
                                 ("DP2 distopt overlap", 2, 2, overlap),
                                 ("TP2 SP", 2, 1, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])])]
        for cname, layouts in plans:
            layouts = [l for l in layouts if wanted(l[0])]
            if not layouts:
                continue
            c = CONFIGS[cname]
            one = run_megaton(a.megaton, c, a.iters)
            if "error" in one:
                rows.append(f"| {cname} | 1 GPU | 1 | error: {one['error']} | | | |")
                continue
            rows.append(f"| {cname} | 1 GPU | 1 | {one['step_ms']:.1f} | {one['tokens_per_s']:,.0f} | 1.00 | {one['peak_mem_gib']:.1f} |")
            for lname, world, dp, flags in layouts:
                r = run_megaton(a.megaton, c, a.iters, launcher=mpirun(world), extra=flags,
                                world=world, dp=dp)
                if "error" in r:
                    rows.append(f"| {cname} | {lname} | {world} | error: {r['error']} | | | |")
                    continue
                eff = r["tokens_per_s_per_gpu"] / one["tokens_per_s"]
                rows.append(f"| {cname} | {lname} | {world} | {r['step_ms']:.1f} | "
                            f"{r['tokens_per_s_per_gpu']:,.0f} | {eff:.2f} | {r['peak_mem_gib']:.1f} |")
            print("\n".join(rows[-1 - len(layouts):]), flush=True)
        lines += [""] + rows
    text = "\n".join(lines)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")

if __name__ == "__main__":
    main()
