"""Megaton vs the PyTorch reference on one GPU, in one run: tokens/s, model TFLOP/s, MFU,
peak memory and the ratio, for the configurations of ../shared/bench/README.md.

Usage (on the GPU machine, from the repository root):
    python3 bench/gpu_bench.py --megaton BIN --torch-script PATH [--configs a,b] [--out FILE]
        [--fp8 tensorwise,delayed,blockwise]
With --fp8, each config also gets FP8 rows: Megaton per recipe (--fp8-format hybrid) and
the reference's torchao float8 linears (--fp8 tensorwise; torchao must be importable),
each row's last column its ratio to PyTorch bf16 and, for Megaton, to torchao FP8.
Both sides train on random tokens, bf16 compute with fp32 master weights, AdamW, no
dropout. Megaton's step time is the median of its logged interval means after warmup;
PyTorch's is its own CUDA-event mean over 20 steps after 5 warmup steps. Model FLOPs use
the reference's PaLM convention for both (6 x active matmul params + 12 x L x h x s).
"""
import argparse, json, re, statistics, subprocess, sys

CONFIGS = {  # name: layers, hidden, heads, ffn, experts, topk, expert ffn, seq, micro-batch
    # (kv: query groups, 0 = heads; vocab: 0 = VOCAB)
    "gpt2-124M": dict(layers=12, hidden=768, heads=12, ffn=2048, experts=0, topk=0, mffn=0, seq=1024, mbs=16),
    "llama-1.3B": dict(layers=24, hidden=2048, heads=16, ffn=5632, experts=0, topk=0, mffn=0, seq=2048, mbs=4),
    "moe-8x-top2": dict(layers=12, hidden=1536, heads=12, ffn=0, experts=8, topk=2, mffn=4096, seq=2048, mbs=4),
    "moe-64x-top8": dict(layers=8, hidden=2048, heads=16, ffn=0, experts=64, topk=8, mffn=1024, seq=2048, mbs=4),
    "llama3-8B-8L": dict(layers=8, hidden=4096, heads=32, kv=8, ffn=14336, experts=0, topk=0, mffn=0,
                         seq=4096, mbs=2, vocab=128256),
    # The whole Llama-3-8B (issue 18): PyTorch's reference cannot hold its 16 bytes per
    # parameter (128 GB) and activations on one H200; its row shows the error.
    "llama3-8B": dict(layers=32, hidden=4096, heads=32, kv=8, ffn=14336, experts=0, topk=0, mffn=0,
                      seq=4096, mbs=1, vocab=128256),
    # DeepSeek-V3's layer kinds at one H200's size (issue 20): MLA with q LoRA and YaRN, a
    # dense first layer then 64 experts top-6 in 8 groups (4 kept) with a sigmoid router,
    # expert bias and one shared expert, one MTP depth. Megaton only: the PyTorch
    # reference has no MLA. FLOPs: flops_per_token's MLA branch.
    "deepseek-v3-small": dict(layers=8, hidden=2048, heads=16, ffn=8192, experts=64, topk=6,
                              mffn=1024, seq=4096, mbs=2, vocab=129280, megaton_only=True,
                              mla=dict(q_lora=768, kv_lora=512, qk=128, rope=64, v=128),
                              shared=1024, dense_first=1, mtp=1,
                              extra=["--multi-latent-attention", "--q-lora-rank", "768",
                                     "--kv-lora-rank", "512", "--qk-head-dim", "128",
                                     "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128",
                                     "--qk-layernorm", "--rotary-scaling-factor", "40",
                                     "--mscale", "1.0", "--mscale-all-dim", "1.0",
                                     "--norm-epsilon", "1e-6", "--ffn-hidden-size", "8192",
                                     "--moe-layer-freq", "[0]*1+[1]*7",
                                     "--moe-router-score-function", "sigmoid",
                                     "--moe-router-enable-expert-bias",
                                     "--moe-router-num-groups", "8", "--moe-router-group-topk", "4",
                                     "--moe-router-topk-scaling-factor", "2.5",
                                     "--moe-router-load-balancing-type", "seq_aux_loss",
                                     "--moe-shared-expert-intermediate-size", "1024",
                                     "--moe-token-dispatcher-type", "alltoall",
                                     "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1"]),
    # A Nemotron-H-like hybrid (issue 23): 24 layers "M-M-M*" x 4 (12 Mamba-2, 8 MLP, 4
    # attention: 1 in 6), Mamba 80 heads of 64 in 8 groups of state 128 (d_inner 2 x hidden),
    # GQA attention (20 heads of 128, 4 KV groups) without position embedding, squared-ReLU
    # MLPs of 4 x hidden: 1.28 B parameters. Megaton only: the PyTorch reference has no
    # Mamba-2, and transformers' NemotronH without the mamba_ssm kernels (not installed
    # there) is no fair baseline. FLOPs: hybrid_flops_per_token.
    "hybrid-1.3B": dict(layers=24, hidden=2560, heads=20, kv=4, ffn=10240, experts=0, topk=0,
                        mffn=0, seq=4096, mbs=2, megaton_only=True,
                        hybrid=dict(pattern="M-M-M*" * 4, head_dim=64, groups=8, state=128)),
}
VOCAB = 50304

def vocab(c):
    return c.get("vocab") or VOCAB

def flops_per_token(c):
    if c.get("mla"):
        return mla_flops_per_token(c)
    if c.get("hybrid"):
        return hybrid_flops_per_token(c)
    h, hd = c["hidden"], c["hidden"] // c["heads"]
    kv = c.get("kv") or c["heads"]
    attn = (c["heads"] + 2 * kv) * hd * h + c["heads"] * hd * h
    if c["experts"]:
        per_layer = attn + h * c["experts"] + c["topk"] * 3 * h * c["mffn"]
    else:
        per_layer = attn + 3 * h * c["ffn"]
    n_active = c["layers"] * per_layer + vocab(c) * h
    return 6 * n_active + 12 * c["layers"] * h * c["seq"]

def mla_flops_per_token(c):
    """The same PaLM convention for an MLA model: 6 x active matmul params (MLA's
    projections, the routed top-k experts, the shared expert, the router, the dense first
    layers, each MTP depth's layer, eh_proj and logits) + 6 x L x s x heads x (qk + rope + v)
    for QK^T and PV (not halved by the causal mask, as the reference's 12 L h s)."""
    h, n, m = c["hidden"], c["heads"], c["mla"]
    dq = m["qk"] + m["rope"]
    attn = (h * m["q_lora"] + m["q_lora"] * n * dq + h * (m["kv_lora"] + m["rope"]) +
            m["kv_lora"] * n * (m["qk"] + m["v"]) + n * m["v"] * h)
    moe = h * c["experts"] + c["topk"] * 3 * h * c["mffn"] + 3 * h * c.get("shared", 0)
    dense = 3 * h * c["ffn"]
    layers = c["layers"] + c.get("mtp", 0)
    n_dense = c.get("dense_first", 0)
    n_active = (layers * attn + n_dense * dense + (layers - n_dense) * moe +
                c.get("mtp", 0) * (2 * h * h + vocab(c) * h) + vocab(c) * h)
    return 6 * n_active + 6 * layers * c["seq"] * n * (dq + m["v"])

def hybrid_flops_per_token(c):
    """The PaLM convention for a hybrid model: 6 x matmul params of each layer's one part
    (a Mamba-2 mixer's in_proj [2 d + 2 G N + heads, h] and out_proj [h, d]; attention's
    QKV and projection; the squared-ReLU MLP's two matrices) and the logits, + 12 x h x s
    per attention layer for QK^T and PV, + 3 x 7 x d x N per Mamba layer for the scan
    (Megatron's mamba_layer_flops estimate)."""
    h, hy = c["hidden"], c["hybrid"]
    d = 2 * h
    heads_m = d // hy["head_dim"]
    hd = h // c["heads"]
    kv = c.get("kv") or c["heads"]
    pattern = hy["pattern"]
    mamba = h * (2 * d + 2 * hy["groups"] * hy["state"] + heads_m) + d * h
    attn = (c["heads"] + 2 * kv) * hd * h + c["heads"] * hd * h
    mlp = 2 * h * c["ffn"]
    n_active = (pattern.count("M") * mamba + pattern.count("*") * attn +
                pattern.count("-") * mlp + vocab(c) * h)
    return (6 * n_active + 12 * pattern.count("*") * h * c["seq"] +
            3 * 7 * pattern.count("M") * d * hy["state"])

def failure_summary(text, lines=4):
    """The lines of a failed run's output that say why: Megaton's error lines ("error:",
    "communication error:", "internal error:", a signal's report), else the last non-empty
    lines that are not mpirun's dashed banners; `lines` of them, joined by " / "."""
    rows = [l.strip() for l in text.splitlines() if l.strip() and not set(l.strip()) <= set("-=")]
    keys = ("error", "Error", "Signal", "signal", "Segmentation", "Aborted", "terminate")
    picked = [l for l in rows if any(k in l for k in keys)] or rows
    return " / ".join(l[:200] for l in picked[-lines:]) or "no output"


def run_megaton(binary, c, iters, launcher=(), extra=(), world=1, dp=1, micro_batches=1):
    """One Megaton run; launcher (e.g. mpirun -np 2 ...) and extra flags for parallel
    layouts: world GPUs, of which dp data-parallel; global batch = micro-batch x dp x
    micro_batches (micro-batches per data-parallel rank and step).
    tokens_per_s is for the whole job; tokens_per_s_per_gpu divides by world."""
    gbs = c["mbs"] * dp * micro_batches
    cmd = list(launcher) + [binary, "train", "--device", "cuda", "--bf16", "--mock-data",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab(c) - 1),
           "--num-layers", str(c["layers"]), "--hidden-size", str(c["hidden"]),
           "--num-attention-heads", str(c["heads"]), "--seq-length", str(c["seq"]),
           "--micro-batch-size", str(c["mbs"]), "--global-batch-size", str(gbs),
           "--swiglu", "--normalization", "RMSNorm",
           "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
           "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--train-iters", str(iters), "--log-interval", "5", "--eval-iters", "0",
           "--lr", "1e-4", "--lr-warmup-iters", "1"]
    if c["experts"]:
        cmd += ["--num-experts", str(c["experts"]), "--moe-router-topk", str(c["topk"]),
                "--moe-ffn-hidden-size", str(c["mffn"]), "--moe-aux-loss-coeff", "1e-2"]
    else:
        cmd += ["--ffn-hidden-size", str(c["ffn"])]
    cmd += c.get("extra", [])
    if c.get("hybrid"):  # Nemotron-H's layers: squared ReLU, no position embedding
        hy = c["hybrid"]
        cmd.remove("--swiglu")
        cmd[cmd.index("--position-embedding-type") + 1] = "none"
        cmd += ["--squared-relu", "--hybrid-layer-pattern", hy["pattern"],
                "--mamba-head-dim", str(hy["head_dim"]), "--mamba-num-groups", str(hy["groups"]),
                "--mamba-state-dim", str(hy["state"])]
    if c.get("kv"):
        cmd += ["--group-query-attention", "--num-query-groups", str(c["kv"])]
    cmd += list(extra)
    if "--fp16" in extra:  # an fp16 variant replaces the default --bf16
        cmd.remove("--bf16")
    # The memory plan's prediction for the same flags (megaton train --dry-run: nothing runs).
    plan = subprocess.run(cmd + ["--dry-run"], capture_output=True, text=True)
    planned = re.search(r"= total \(the planned peak\) +\d+ +[\d.]+ +([\d.]+)", plan.stdout)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return dict(error=failure_summary(out.stderr + "\n" + out.stdout))
    rows = [l for l in out.stdout.splitlines() if l.startswith(" iteration")]
    # The first interval has the warmup; megaton's last one measures only the work left in
    # the CUDA launch queue when the host finished queuing (llama-1.3B TP2 with
    # --log-interval 1: 75.6 ms against 335 for the others), so both are left out
    # (docs/performance.md, "MoE overlaps, flex and step timing").
    ms = [float(re.search(r"per iteration \(ms\): ([\d.]+)", l).group(1)) for l in rows]
    ms = ms[1:-1] if len(ms) >= 3 else ms[1:]
    mem = float(re.search(r"peak memory \(MB\): ([\d.]+)", rows[-1]).group(1))
    step_ms = statistics.median(ms)
    tokens_per_s = gbs * c["seq"] / (step_ms / 1e3)
    r = dict(step_ms=step_ms, tokens_per_s=tokens_per_s,
             tokens_per_s_per_gpu=tokens_per_s / world, peak_mem_gib=mem * 2**20 / 2**30)
    if planned:
        r["plan_gib"] = float(planned.group(1)) * 2**20 / 2**30
    # With MEGATON_OP_PROFILE=1 in the environment: the last op profile table (rank 0's).
    at = out.stdout.rfind(" op profile")
    if at >= 0:
        r["op_profile"] = out.stdout[at:].strip()
    return r

def run_torch(script, name, c, fp8="none"):
    cmd = [sys.executable, script, "--name", name, "--layers", str(c["layers"]),
           "--hidden", str(c["hidden"]), "--heads", str(c["heads"]), "--seq", str(c["seq"]),
           "--mbs", str(c["mbs"]), "--vocab", str(vocab(c)), "--fp8", fp8]
    if c.get("kv"):
        cmd += ["--kv-heads", str(c["kv"])]
    cmd += (["--experts", str(c["experts"]), "--topk", str(c["topk"]), "--moe-ffn", str(c["mffn"])]
            if c["experts"] else ["--ffn", str(c["ffn"])])
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if not lines:
        return dict(error=(out.stderr or "no output").strip().splitlines()[-1][:200])
    return json.loads(lines[-1])

def row(name, impl, r, f, base=None, base2=None):
    """One table row; base (and base2): results whose tokens/s the ratio column divides by."""
    if "error" in r:
        return f"| {name} | {impl} | error: {r['error']} | | | | |"
    tps = r["tokens_per_s"]
    ratios = [f"{tps / b['tokens_per_s']:.2f}" for b in (base, base2) if b and "error" not in b]
    peak = f"{r['peak_mem_gib']:.1f}"
    if "plan_gib" in r:  # the memory plan's prediction beside the measured peak
        peak += f" (plan {r['plan_gib']:.1f})"
    return (f"| {name} | {impl} | {tps:,.0f} | {f * tps / 1e12:.0f} | {f * tps / 989e12:.3f} | "
            f"{peak} | {' / '.join(ratios)} |")

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--megaton", required=True)
    p.add_argument("--torch-script", required=True)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--fp8", default="", help="Megaton FP8 recipes to add, comma-separated")
    p.add_argument("--cuda-graph", action="store_true",
                   help="add Megaton rows with --cuda-graph-impl full_iteration")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=FLAGS: a Megaton bf16 row with these extra flags (repeatable), "
                        "e.g. 'lean=--recompute-granularity selective "
                        "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16'")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    p.add_argument("--no-default", action="store_true", help="skip Megaton's default-flags row")
    p.add_argument("--out", default="")
    a = p.parse_args()
    variants = [v.split("=", 1) for v in a.variant]
    graph = ["--cuda-graph-impl", "full_iteration"]
    lines = ["| config | impl | tokens/s | model TFLOP/s | MFU (989) | peak GiB | ratio to PyTorch bf16 (/ torchao FP8) |",
             "|---|---|---|---|---|---|---|"]
    for name in a.configs.split(","):
        c = CONFIGS[name]
        f = flops_per_token(c)
        t = (dict(error="not run (--no-torch)") if a.no_torch else
             dict(error="no PyTorch reference (no MLA / Mamba-2 there)") if c.get("megaton_only") else
             run_torch(a.torch_script, name, c))
        new = [row(name, "PyTorch bf16", t, f)]
        m = {}
        if not a.no_default:
            m = run_megaton(a.megaton, c, a.iters)
            new.append(row(name, "Megaton bf16", m, f, t))
        for vname, vflags in variants:
            new.append(row(name, f"Megaton bf16 {vname}", run_megaton(a.megaton, c, a.iters,
                                                                      extra=vflags.split()), f, t))
        if a.cuda_graph:
            new.append(row(name, "Megaton bf16 + CUDA graph", run_megaton(a.megaton, c, a.iters, extra=graph), f, t))
        if a.fp8 and not c.get("megaton_only"):
            t8 = run_torch(a.torch_script, name, c, "tensorwise")
            new.append(row(name, "PyTorch torchao FP8 tensorwise", t8, f, t))
            for recipe in a.fp8.split(","):
                m8 = run_megaton(a.megaton, c, a.iters,
                                 extra=["--fp8-format", "hybrid", "--fp8-recipe", recipe])
                new.append(row(name, f"Megaton FP8 {recipe}", m8, f, t, t8))
                if a.cuda_graph:
                    m8g = run_megaton(a.megaton, c, a.iters, extra=["--fp8-format", "hybrid",
                                                                    "--fp8-recipe", recipe] + graph)
                    new.append(row(name, f"Megaton FP8 {recipe} + CUDA graph", m8g, f, t, t8))
                if "op_profile" in m8:
                    print(m8["op_profile"], flush=True)
        lines += new
        print("\n".join(new), flush=True)
    table = "\n".join(lines)
    print(table)
    if a.out:
        open(a.out, "w").write(table + "\n")

if __name__ == "__main__":
    main()
