"""Scaling on one multi-GPU node (issue 6), in one run on the GPU machine.

Usage (from the repository root, binaries from tools/gpu_bundle.sh, data/ prepared):
    python3 bench/gpu_scaling.py --megaton BIN --gpus N [--out FILE] [--skip-curves]
        [--skip-scaling] [--only 'name,name'] [--op-profile]

N = 8 is the issue's run; N = 4 runs the same layouts at half size.

1. Scaling, the benchmark configurations of ../shared/bench/README.md on random tokens:
   - moe-64x-top8, EP N (data parallel N over the dense layers), all-to-all dispatcher,
     distributed optimizer with overlapped grad reduce and param gather; once with the
     default token exchange (pull through peer memory on one node) and once with
     MEGATON_MOE_ALLTOALL_EXCHANGE=regroup ("EP N alltoall regroup");
   - llama-1.3B, DP N + distributed optimizer + both overlaps; DP N under Megatron-FSDP
     (optim_grads, optim_grads_params); TP2 (+ SP) x DP N/2, without and with
     --tp-comm-overlap;
     PP2 x DP N/2 interleaved (2 model chunks per stage), each with the distributed
     optimizer.
   Every run, the one-GPU reference included, trains the same global batch (micro-batch 4,
   gradient accumulation on one GPU), so each GPU of an N-GPU run does 1/N of the
   reference's work per step (the optimizer too: the distributed optimizer shards it).
   Scaling efficiency = tokens/s per GPU over the one-GPU run's tokens/s; peak memory per
   GPU (rank 0's allocator peak) is reported beside it. --op-profile runs them all with
   MEGATON_OP_PROFILE=1 and prints rank 0's GPU time per op (NCCL collectives included)
   after each row; profiled step times are not comparable with unprofiled ones.
2. Loss curves: the demo model (configs/demo-moe.yaml, fortunes corpus, bf16) for 50
   iterations on one GPU and under each layout above (same global batch 16, micro-batch
   16 / N), lm loss per iteration against the one-GPU curve.
"""
import argparse, contextlib, json, os, subprocess, sys, tempfile

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench import CONFIGS, run_megaton  # noqa: E402
from gpu_parallel import curve, mpirun  # noqa: E402


OVERLAP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]


def layouts(n, layers):
    """name -> (flags, dp) of the issue's layouts on n GPUs for a model of `layers` layers."""
    half = n // 2
    ep = ["--expert-model-parallel-size", str(n), "--moe-token-dispatcher-type", "alltoall"]
    return {
        f"EP{n} alltoall": (ep + OVERLAP, n),
        # The same with the tokens exchanged by NCCL all-to-all and regrouping copies
        # (Megatron's way) instead of the default pull through peer memory (see env_of).
        f"EP{n} alltoall regroup": (ep + OVERLAP, n),
        f"DP{n}": (OVERLAP, n),
        # Megatron-FSDP (issue 22) against the distributed optimizer above: gradients, then
        # weights too, sharded and gathered / reduced by layer.
        f"DP{n} FSDP optim_grads": (FSDP + ["optim_grads"], n),
        f"DP{n} FSDP optim_grads_params": (FSDP + ["optim_grads_params"], n),
        f"TP2 SP x DP{half}": (["--tensor-model-parallel-size", "2", "--sequence-parallel"]
                               + OVERLAP, half),
        # The same with the sequence all-gathers / reduce-scatters beside the GEMMs (issue 22).
        f"TP2 SP x DP{half} tp-comm-overlap": (["--tensor-model-parallel-size", "2",
                                                "--sequence-parallel", "--tp-comm-overlap"]
                                               + OVERLAP, half),
        f"PP2 x DP{half} interleaved": (["--pipeline-model-parallel-size", "2",
                                         "--num-layers-per-virtual-pipeline-stage",
                                         str(layers // 4)] + OVERLAP, half),
    }


@contextlib.contextmanager
def env_of(name):
    """The environment of layout `name` while its run is launched: MEGATON_MOE_ALLTOALL_EXCHANGE
    =regroup for the "... regroup" layouts (mpirun forwards MEGATON_* variables)."""
    key = "MEGATON_MOE_ALLTOALL_EXCHANGE"
    before = os.environ.get(key)
    if name.endswith(" regroup"):
        os.environ[key] = "regroup"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def demo_curve(binary, name, launcher, flags, work, mbs):
    """gpu_parallel.curve (the demo config, 50 bf16 iterations) at global batch 16."""
    return curve(binary, name.replace(" ", "-"), launcher,
                 ["--micro-batch-size", str(mbs), "--global-batch-size", "16"] + list(flags), work)


def show_profile(profiles, title, result):
    """Appends (and prints) the op profile of one run, when it has one."""
    if "op_profile" in result:
        profiles.extend(["", f"{title}:", "```", result["op_profile"], "```"])
        print("\n".join(profiles[-4:]), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--megaton", required=True)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="")
    p.add_argument("--skip-curves", action="store_true")
    p.add_argument("--skip-scaling", action="store_true")
    p.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    p.add_argument("--op-profile", action="store_true",
                   help="MEGATON_OP_PROFILE=1 for the scaling runs; print their op tables")
    a = p.parse_args()
    if a.op_profile:
        os.environ["MEGATON_OP_PROFILE"] = "1"
    profiles = []
    n = a.gpus
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    wanted = lambda name: not only or name in only
    lines = []
    if not a.skip_scaling:
        rows = ["| config | layout | GPUs | global batch | step ms | tokens/s per GPU | "
                "scaling efficiency | peak GiB per GPU |", "|---|---|---|---|---|---|---|---|"]
        # config -> (layouts, micro-batches of the one-GPU reference per step)
        plans = [("moe-64x-top8", [f"EP{n} alltoall", f"EP{n} alltoall regroup"], n),
                 ("llama-1.3B", [f"DP{n}", f"DP{n} FSDP optim_grads", f"DP{n} FSDP optim_grads_params",
                                 f"TP2 SP x DP{n // 2}", f"TP2 SP x DP{n // 2} tp-comm-overlap",
                                 f"PP2 x DP{n // 2} interleaved"], 2 * n)]
        for cname, names, ref_micro in plans:
            names = [x for x in names if wanted(x)]
            if not names:
                continue
            c = CONFIGS[cname]
            gbs = c["mbs"] * ref_micro
            one = run_megaton(a.megaton, c, a.iters, micro_batches=ref_micro)
            if "error" in one:
                rows.append(f"| {cname} | 1 GPU | 1 | {gbs} | error: {one['error']} | | | |")
                print(rows[-1], flush=True)
                continue
            rows.append(f"| {cname} | 1 GPU | 1 | {gbs} | {one['step_ms']:.1f} | "
                        f"{one['tokens_per_s']:,.0f} | 1.00 | {one['peak_mem_gib']:.1f} |")
            print(rows[-1], flush=True)
            show_profile(profiles, f"{cname}, 1 GPU", one)
            for lname in names:
                flags, dp = layouts(n, c["layers"])[lname]
                with env_of(lname):
                    r = run_megaton(a.megaton, c, a.iters, launcher=mpirun(n), extra=flags,
                                    world=n, dp=dp, micro_batches=gbs // (c["mbs"] * dp))
                if "error" in r:
                    rows.append(f"| {cname} | {lname} | {n} | {gbs} | error: {r['error']} | | | |")
                else:
                    eff = r["tokens_per_s_per_gpu"] / one["tokens_per_s"]
                    rows.append(f"| {cname} | {lname} | {n} | {gbs} | {r['step_ms']:.1f} | "
                                f"{r['tokens_per_s_per_gpu']:,.0f} | {eff:.2f} | "
                                f"{r['peak_mem_gib']:.1f} |")
                print(rows[-1], flush=True)
                show_profile(profiles, f"{cname}, {lname}", r)
        lines += rows + profiles
    if not a.skip_curves:
        work = tempfile.mkdtemp()
        ref, err = demo_curve(a.megaton, "one-gpu", [], [], work, 16 // n)
        lines += ["", "| layout (demo model, 50 iterations) | lm loss it 1 | it 50 | "
                  "worst relative difference vs 1 GPU |", "|---|---|---|---|"]
        if ref is None:
            lines.append(f"| 1 GPU | error: {err} | | |")
        else:
            lines.append(f"| 1 GPU | {ref[0]:.4f} | {ref[-1]:.4f} | |")
            # The control: one GPU again, accumulating micro-batches of half the size. Equal
            # in exact arithmetic, so its distance is what bf16 summation order alone does.
            runs = [("1 GPU, half micro-batches (control)", [], [], max(1, 8 // n))]
            runs += [(name, mpirun(n), flags, 16 // n)
                     for name, (flags, _) in layouts(n, 4).items() if wanted(name)]
            for name, launcher, flags, mbs in runs:
                with env_of(name):
                    got, err = demo_curve(a.megaton, name, mpirun(n) if launcher else [], flags,
                                          work, mbs)
                if got is None:
                    lines.append(f"| {name} | error: {err} | | |")
                    continue
                worst = (max(abs(x - y) / y for x, y in zip(got, ref))
                         if len(got) == len(ref) else float("nan"))
                lines.append(f"| {name} | {got[0]:.4f} | {got[-1]:.4f} | {worst:.2e} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
