"""Muon against Adam on the GPU (issue 24), in one run on the GPU machine.

Usage (from the repository root, binaries from tools/gpu_bundle.sh, data/ prepared for
--curves):
    python3 bench/muon_bench.py --megaton BIN [--single] [--dp N] [--curves] [--out FILE]

--single: llama-1.3B and moe-8x-top2 (bench/gpu_bench.py's configs) on one GPU with Adam,
    Muon (bf16 Newton-Schulz, Megatron's default --muon-fp32-matmul-prec medium) and Muon
    in TF32 (high): the whole step's tokens/s and peak memory from an unprofiled run, and
    the optimizer step's GPU time per rule from a run under MEGATON_OP_PROFILE=1
    (DistributedAdamW's optimizer_adam / optimizer_muon rows: each rule's update with its
    ops and collectives, per iteration).
--dp N: llama-1.3B on N GPUs, each with its own micro-batch: Adam with the distributed
    optimizer, Muon replicated (every rank orthogonalises every matrix), Muon with the
    layer-wise distributed optimizer, and the latter with --overlap-grad-reduce
    --overlap-param-gather.
--curves: the demo config (configs/demo-moe.yaml, the fortunes corpus, 500 iterations)
    in bf16 on the GPU with Adam and with Muon (--muon-extra-scale-factor 0.2, Moonlight's match to Adam's
    update RMS) over a learning-rate sweep: the validation loss every 100 iterations and the
    training loss every 10.
"""
import argparse, json, os, re, subprocess, sys

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench import CONFIGS, run_megaton  # noqa: E402
from gpu_parallel import mpirun  # noqa: E402

OPTIMIZERS = {
    "adam": [],
    "muon": ["--optimizer", "muon"],
    "muon-tf32": ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"],
}


def optimizer_ms(profile):
    """{rule: ms per iteration} from an op profile table."""
    out = {}
    for line in (profile or "").splitlines():
        m = re.match(r"\s*(optimizer_\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", line)
        if m:
            out[m.group(1)] = float(m.group(3))
    return out


def single(binary, iters, lines, optimizers=tuple(OPTIMIZERS)):
    lines += ["| config | optimizer | step ms | tokens/s | peak GiB | Adam update ms | Muon update ms |",
              "|---|---|---|---|---|---|---|"]
    for name in ["llama-1.3B", "moe-8x-top2"]:
        c = CONFIGS[name]
        for opt in optimizers:
            flags = OPTIMIZERS[opt]
            r = run_megaton(binary, c, iters, extra=flags)
            os.environ["MEGATON_OP_PROFILE"] = "1"
            p = run_megaton(binary, c, 12, extra=flags)
            del os.environ["MEGATON_OP_PROFILE"]
            if "error" in r or "error" in p:
                lines.append(f"| {name} | {opt} | error: {r.get('error') or p.get('error')} |")
                continue
            ms = optimizer_ms(p.get("op_profile"))
            lines.append(f"| {name} | {opt} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                         f"{r['peak_mem_gib']:.1f} | {ms.get('optimizer_adam', 0):.2f} | "
                         f"{ms.get('optimizer_muon', 0):.2f} |")
            print(lines[-1], flush=True)
            if opt == "muon":
                print(p.get("op_profile", "")[:3000], flush=True)


def data_parallel(binary, iters, lines, n):
    c = CONFIGS["llama-1.3B"]
    overlap = ["--overlap-grad-reduce", "--overlap-param-gather"]
    runs = {
        "adam, distributed optimizer": ["--use-distributed-optimizer"],
        "adam, distributed optimizer + overlap": ["--use-distributed-optimizer"] + overlap,
        "muon, replicated": ["--optimizer", "muon"],
        "muon, layer-wise": ["--optimizer", "muon", "--use-distributed-optimizer"],
        "muon, layer-wise + overlap": ["--optimizer", "muon", "--use-distributed-optimizer"] + overlap,
    }
    lines += ["", f"| llama-1.3B, DP{n} ({n} x H200) | step ms | tokens/s per GPU | peak GiB | Muon update ms (rank 0) |",
              "|---|---|---|---|---|"]
    for label, flags in runs.items():
        r = run_megaton(binary, c, iters, launcher=mpirun(n), extra=flags, world=n, dp=n)
        os.environ["MEGATON_OP_PROFILE"] = "1"
        p = run_megaton(binary, c, 12, launcher=mpirun(n), extra=flags, world=n, dp=n)
        del os.environ["MEGATON_OP_PROFILE"]
        if "error" in r:
            lines.append(f"| {label} | error: {r['error']} |")
            continue
        ms = optimizer_ms(p.get("op_profile"))
        lines.append(f"| {label} | {r['step_ms']:.1f} | {r['tokens_per_s_per_gpu']:,.0f} | "
                     f"{r['peak_mem_gib']:.1f} | {ms.get('optimizer_muon', 0):.2f} |")
        print(lines[-1], flush=True)


def curves(binary, out_dir, lines, iters=500, device="cuda"):
    sweeps = [("adam", lr, []) for lr in ("1e-3", "2e-3", "4e-3", "8e-3")] + [
        ("muon", lr, ["--optimizer", "muon", "--muon-extra-scale-factor", "0.2"])
        for lr in ("1e-3", "2e-3", "4e-3", "8e-3")]
    results = {}
    for opt, lr, flags in sweeps:
        name = f"{opt}-lr{lr}"
        metrics = os.path.join(out_dir, name + ".jsonl")
        cmd = [binary, "train", "--config", "configs/demo-moe.yaml", "--device", device,
               "--train-iters", str(iters), "--eval-interval", str(max(iters // 5, 1)),
               "--lr-warmup-iters", str(max(iters // 10, 1)),
               "--lr", lr, "--min-lr", str(float(lr) / 10), "--save-interval", "0",
               "--log-metrics-file", metrics] + (["--bf16"] if device == "cuda" else []) + flags
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            results[name] = dict(error=out.stderr[-500:])
            continue
        valid = [float(v) for v in re.findall(
            r"validation loss at iteration \d+.*?lm loss value: ([\d.E+-]+)", out.stdout)]
        end = re.findall(r"validation loss at the end.*?lm loss value: ([\d.E+-]+)", out.stdout)
        train = [float(v) for v in re.findall(r"\| lm loss: ([\d.E+-]+)", out.stdout)]
        results[name] = dict(valid=valid, end=float(end[0]) if end else None, train=train)
        print(name, results[name].get("valid"), results[name].get("end"), flush=True)
    json.dump(results, open(os.path.join(out_dir, "muon_curves.json"), "w"))
    lines += ["", f"| demo-moe run | validation loss every {max(iters // 5, 1)} iterations from 0 | end |",
              "|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | error | |")
        else:
            lines.append(f"| {name} | {', '.join(f'{v:.3f}' for v in r['valid'])} | {r['end']} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--megaton", required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--single", action="store_true")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="--single's rows")
    p.add_argument("--dp", type=int, default=0, help="the data-parallel runs on this many GPUs")
    p.add_argument("--curves", action="store_true")
    p.add_argument("--curves-dir", default=".")
    p.add_argument("--curve-iters", type=int, default=500)
    p.add_argument("--device", default="cuda", help="--curves' device (cpu for a quick check)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    lines = []
    if a.single:
        single(a.megaton, a.iters, lines, a.optimizers.split(","))
    if a.dp:
        data_parallel(a.megaton, a.iters, lines, a.dp)
    if a.curves:
        curves(a.megaton, a.curves_dir, lines, a.curve_iters, a.device)
    text = "\n".join(lines)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
