#!/usr/bin/env python3
"""Golden data for Megaton's Muon optimizer, from NVIDIA's Emerging-Optimizers package.

Megatron-LM's Muon (--optimizer muon) takes its maths from the `emerging_optimizers`
package (NVIDIA-NeMo/Emerging-Optimizers; Megatron-LM's pyproject.toml pins git tag v0.3.0,
commit b309e2f01cda, the same files as PyPI's emerging-optimizers 0.3.0). This script
imports that package and calls it; it contains none of its code. It writes
tests/golden/muon_golden.safetensors with:

- ns.*: Newton-Schulz outputs, `muon_utils.newton_schulz(x, steps, coefficient_type)`,
  for every coefficient type of v0.3.0 (simple, quintic, polar_express, cans, aol,
  deepseekv4) with 5 steps, on four seeded float32 inputs: tall [48, 16] (transposed
  inside), wide [16, 40], square [24, 24] and ill-conditioned [40, 24] (U diag(s) V^T,
  s log-spaced from 1 to 1e-4); plus quintic with 1, 3 and 8 steps (8 wraps around the 5
  sets), polar_express with 10 (past its 8 sets), cans with 7 (past its 5), aol with 4
  (its 4 sets once: 5 steps wrap) and deepseekv4 with 11 (its 8 + 2 sets and one more),
  which pin the cycle / repeat-last rule;
- scale.*: `muon.get_muon_scale_factor(size_out, size_in, mode)` for each scale mode on
  a few shapes;
- muon.plain.* / muon.nesterov.*: three optimizer steps of one [32, 24] parameter as
  Megatron configures Muon (EMA momentum 0.9, nesterov off / on, lr 0.02, decoupled
  weight decay 0.1, quintic 5 steps, spectral scale, extra scale factor 0.2);
- qkv.*: a linear_qkv update [ng * (q + 2 hn), h] (2 query groups of 2 heads, head dim 4,
  hidden 16) orthogonalised as Megatron does with --muon-split-qkv (the default): Q, K
  and V each across all groups, each its own Newton-Schulz and scale.

Everything is float32 with torch.set_float32_matmul_precision("highest") (no bf16 or TF32
rounding; Megatron's default --muon-fp32-matmul-prec medium would run the iteration in
bf16), on the CPU with one thread.

The optimizer and QKV cases: with --megatron PATH (a Megatron-LM checkout), they are run
through Megatron's own TensorParallelMuon (megatron/core/optimizer/emerging_optimizers.py)
on one rank without torch.distributed (pg_collection None, no partition_dim: with TP 1
the "duplicated" TP mode all-gathers over a group of one, which changes nothing), and the
package-only composition below is asserted to give the same bits. Without --megatron the
package-only composition is used: EO's `Muon` class (OrthogonalizedOptimizer with
scaled_orthogonalize_fn = newton_schulz x get_muon_scale_factor(rows, cols) x extra, which
is what TensorParallelMuon.scaled_orthogonalize_fn computes for TP 1, lines 209-237 at
Megatron-LM d98e8a64ddf3), and for QKV the view / split / per-piece orthogonalise / cat
of TensorParallelMuon.orthogonalize (lines 407-437 there), written out here.

Run (Python >= 3.12: emerging-optimizers 0.3.0 requires it)

    python3.12 -m venv /tmp/golden-venv-py312
    /tmp/golden-venv-py312/bin/pip install -r tools/requirements-golden.txt
    /tmp/golden-venv-py312/bin/python tools/make_muon_golden.py \\
        [--megatron /path/to/Megatron-LM [--megatron-commit SHA]]   # writes, then checks
    /tmp/golden-venv-py312/bin/python tools/make_muon_golden.py --check-only [--megatron ...]

--check-only reloads the file, regenerates the inputs from the seed and recomputes every
output, asserting bit equality; it also measures how far each Newton-Schulz output is
from the exact polar factor U V^T of its input (SVD in float64) and prints it (these
coefficient sets are not exact orthogonalisers; nothing tight is asserted there).
"""

import argparse
import hashlib
import inspect
import json
import math
import os
import platform
import subprocess
import sys
import warnings

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

try:
    import emerging_optimizers
    from emerging_optimizers import utils as eo_utils
    from emerging_optimizers.orthogonalized_optimizers import muon as eo_muon
    from emerging_optimizers.orthogonalized_optimizers import muon_utils
except ImportError as e:  # pragma: no cover
    sys.exit(f"error: emerging_optimizers is not importable ({e}); "
             "pip install -r tools/requirements-golden.txt under Python >= 3.12")

EXPECTED_EO_VERSION = "0.3.0"
SEED = 1234
FILE = "muon_golden.safetensors"
MAX_BYTES = 300_000

# Newton-Schulz inputs: name -> (rows, cols).
NS_SHAPES = {"tall": (48, 16), "wide": (16, 40), "square": (24, 24), "illcond": (40, 24)}
ILLCOND_SV = (1.0, 1e-4)  # largest and smallest singular value, log-spaced in between
COEFF_TYPES = ("simple", "quintic", "polar_express", "cans", "aol", "deepseekv4")
NS_STEPS = 5
# Extra step counts, to pin the iteration rule past the end of each list.
EXTRA_STEPS = {"quintic": (1, 3, 8), "polar_express": (10,), "cans": (7,), "aol": (4,),
               "deepseekv4": (11,)}

SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
SCALE_SHAPES = ((32, 24), (24, 32), (16, 16), (8, 16), (48, 16), (4096, 1024), (1024, 4096),
                (2048, 2048))

# The optimizer cases: Megatron's --optimizer muon with these flags (all others default).
PARAM_SHAPE = (32, 24)
OPT_STEPS = 3
PARAM_STD = 0.1
OPT = {
    "lr": 0.02,                        # --lr (the scheduler's value; constant here)
    "momentum": 0.9,                   # --muon-momentum (its default)
    "weight_decay": 0.1,               # --weight-decay
    "weight_decay_method": "decoupled",  # TensorParallelMuon's use_decoupled_weight_decay=True
    "coefficient_type": "quintic",     # --muon-coefficient-type (default)
    "num_ns_steps": 5,                 # --muon-num-ns-steps (default)
    "scale_mode": "spectral",          # --muon-scale-mode (default)
    "extra_scale_factor": 0.2,         # --muon-extra-scale-factor
    "fp32_matmul_prec": "highest",     # not a Megatron choice (medium/high/low): exact fp32
}
OPT_CASES = {"plain": False, "nesterov": True}  # case name -> nesterov (--muon-nesterov)

# QKV: Megatron's linear_qkv of 2 query groups, 2 query heads per group, head dim 4,
# hidden 16: rows per group g = [Q heads of g (2 x 4), K_g (4), V_g (4)].
QKV = {"num_query_groups": 2, "heads_per_group": 2, "head_dim": 4, "hidden": 16}
QKV_SCALE_MODES = ("spectral", "unit_rms_norm")


def qkv_split_shapes():
    q = QKV["heads_per_group"] * QKV["head_dim"]
    return [q, QKV["head_dim"], QKV["head_dim"]]


def qkv_shape():
    return (QKV["num_query_groups"] * sum(qkv_split_shapes()), QKV["hidden"])


# ---------------------------------------------------------------------------------------
# Inputs (float32, from one generator in a fixed order).


def make_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    t = {}
    for name, (m, n) in NS_SHAPES.items():
        if name == "illcond":
            k = min(m, n)
            u, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
            v, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
            s = torch.logspace(math.log10(ILLCOND_SV[0]), math.log10(ILLCOND_SV[1]), k,
                               dtype=torch.float64)
            t[f"ns.input.{name}"] = ((u * s) @ v.T).float()
        else:
            t[f"ns.input.{name}"] = torch.randn(m, n, generator=gen)
    for case in OPT_CASES:
        t[f"muon.{case}.param.0"] = PARAM_STD * torch.randn(*PARAM_SHAPE, generator=gen)
        for k in range(1, OPT_STEPS + 1):
            t[f"muon.{case}.grad.{k}"] = torch.randn(*PARAM_SHAPE, generator=gen)
    t["qkv.update"] = torch.randn(*qkv_shape(), generator=gen)
    return t


# ---------------------------------------------------------------------------------------
# The package's functions.


def ns(x, steps, coefficient_type):
    return muon_utils.newton_schulz(x, steps=steps, coefficient_type=coefficient_type)


def coefficient_sequence(coefficient_type, steps, x):
    """The (a, b, c) the package uses at each of `steps` steps, found with the package.

    Both readings of the list (cycle, repeat-last) are expanded to `steps` entries and
    passed as "custom" sets (custom is cycled, so a list of `steps` entries is used in
    order); exactly one must give the bits of the named type."""
    sets = [tuple(s) for s in muon_utils._COEFFICIENT_SETS[coefficient_type]]
    cycled = [sets[i % len(sets)] for i in range(steps)]
    last = [sets[min(i, len(sets) - 1)] for i in range(steps)]
    ref = ns(x, steps, coefficient_type)
    hits = {}
    for rule, seq in (("cycle", cycled), ("repeat_last", last)):
        out = muon_utils.newton_schulz(x, steps=steps, coefficient_type="custom",
                                       custom_coefficient_sets=seq)
        hits[rule] = torch.equal(out, ref)
    if cycled == last:  # within the list (or a list of one set): the rules agree
        assert hits["cycle"] and hits["repeat_last"], (coefficient_type, steps, hits)
        return cycled, None
    assert hits["cycle"] != hits["repeat_last"], (coefficient_type, steps, hits)
    return (cycled, "cycle") if hits["cycle"] else (last, "repeat_last")


def ns_cases():
    """(output name, coefficient type, steps, input name) for every Newton-Schulz case."""
    cases = []
    for ctype in COEFF_TYPES:
        for steps in sorted({NS_STEPS, *EXTRA_STEPS.get(ctype, ())}):
            for shape in NS_SHAPES:
                cases.append((f"ns.{ctype}.s{steps}.{shape}", ctype, steps, f"ns.input.{shape}"))
    return cases


def eo_muon_optimizer(params, nesterov, **over):
    kw = dict(OPT, **over)
    return eo_muon.Muon(params, lr=kw["lr"], momentum=kw["momentum"],
                        weight_decay=kw["weight_decay"], nesterov=nesterov,
                        weight_decay_method=kw["weight_decay_method"],
                        fp32_matmul_prec=kw["fp32_matmul_prec"],
                        coefficient_type=kw["coefficient_type"],
                        num_ns_steps=kw["num_ns_steps"], scale_mode=kw["scale_mode"],
                        extra_scale_factor=kw["extra_scale_factor"])


def run_steps(make_opt, param0, grads):
    """Steps an optimizer made by make_opt([p]) over grads; returns the params and
    momentum buffers after each step."""
    p = torch.nn.Parameter(param0.clone())
    opt = make_opt([p])
    params, moms = [], []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        params.append(p.detach().clone())
        moms.append(opt.state[p]["momentum_buffer"].clone())
    return params, moms


def eo_split_qkv(update, split_shapes, orthogonalize):
    """TensorParallelMuon.orthogonalize's QKV branch (emerging_optimizers.py lines
    407-437 at Megatron-LM d98e8a64ddf3): view [ng, sum(split), h], split dim 1 into Q, K,
    V, each reshaped to 2-D (all groups stacked, group-major) and orthogonalised and
    scaled on its own, then viewed back and concatenated along dim 1."""
    rows, cols = update.shape
    ng = rows // sum(split_shapes)
    pieces = torch.split(update.view(ng, sum(split_shapes), cols), split_shapes, dim=1)
    outs = [orthogonalize(piece.reshape(-1, cols)).view(ng, -1, cols) for piece in pieces]
    return torch.cat(outs, dim=1).view(rows, cols)


def eo_qkv(update, scale_mode, split):
    opt = eo_muon_optimizer([torch.nn.Parameter(torch.zeros_like(update))], nesterov=False,
                            scale_mode=scale_mode)
    with eo_utils.fp32_matmul_precision(OPT["fp32_matmul_prec"]):
        if split:
            return eo_split_qkv(update, qkv_split_shapes(), opt.scaled_orthogonalize_fn)
        return opt.scaled_orthogonalize_fn(update)


# ---------------------------------------------------------------------------------------
# Megatron-LM's TensorParallelMuon (optional).

MEGATRON_FILE = "megatron/core/optimizer/emerging_optimizers.py"


class MegatronMuon:
    def __init__(self, path, commit):
        path = os.path.abspath(path)
        if not os.path.isfile(os.path.join(path, MEGATRON_FILE)):
            sys.exit(f"error: {path} is not a Megatron-LM checkout (no {MEGATRON_FILE})")
        sys.path.insert(0, path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core.optimizer.emerging_optimizers as emo
        if not os.path.abspath(emo.__file__).startswith(path + os.sep):
            sys.exit(f"error: imported {emo.__file__}, not from {path}")
        if not emo.HAVE_EMERGING_OPTIMIZERS:
            sys.exit("error: Megatron-LM could not import emerging_optimizers")
        self.emo = emo
        self.info = {
            "commit": commit or git_head(path),
            "emerging_optimizers.py_sha256": sha256(os.path.join(path, MEGATRON_FILE)),
        }
        cfg = argparse.Namespace(num_attention_heads=QKV["num_query_groups"] * QKV["heads_per_group"],
                                 num_query_groups=QKV["num_query_groups"], kv_channels=QKV["head_dim"])
        got = emo._get_qkv_split_shapes(cfg)
        assert list(got) == qkv_split_shapes(), (got, qkv_split_shapes())

    def optimizer(self, params, nesterov, **over):
        kw = dict(OPT, **over)
        return self.emo.TensorParallelMuon(
            params, lr=kw["lr"], momentum=kw["momentum"], nesterov=nesterov,
            weight_decay=kw["weight_decay"],
            use_decoupled_weight_decay=kw["weight_decay_method"] == "decoupled",
            split_qkv=True, is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
            qkv_split_shapes=qkv_split_shapes(), fp32_matmul_prec=kw["fp32_matmul_prec"],
            coefficient_type=kw["coefficient_type"], num_ns_steps=kw["num_ns_steps"],
            scale_mode=kw["scale_mode"], extra_scale_factor=kw["extra_scale_factor"],
            pg_collection=None, tp_mode="duplicated")

    def qkv(self, update, scale_mode, split):
        p = torch.nn.Parameter(torch.zeros_like(update))
        p.is_qkv = split
        opt = self.optimizer([p], nesterov=False, scale_mode=scale_mode)
        with eo_utils.fp32_matmul_precision(OPT["fp32_matmul_prec"]):
            return opt.orthogonalize(p, update.clone())


# ---------------------------------------------------------------------------------------
# Computing every output from the inputs.


def compute(inputs, megatron):
    """Returns (tensors, case metadata) computed from `inputs`."""
    out, meta = {}, {"ns": {}, "iteration_rule": {}}
    for name, ctype, steps, src in ns_cases():
        x = inputs[src]
        out[name] = ns(x, steps, ctype)
        seq, rule = coefficient_sequence(ctype, steps, x)
        if rule is not None:
            meta["iteration_rule"][ctype] = rule
        meta["ns"][name] = {"input": src, "coefficient_type": ctype, "steps": steps,
                            "coefficients": [list(abc) for abc in seq]}

    shapes = torch.tensor(SCALE_SHAPES, dtype=torch.int32)
    out["scale.shapes"] = shapes
    meta["scale"] = {"shapes": [list(s) for s in SCALE_SHAPES], "values": {}}
    for mode in SCALE_MODES:
        vals = [eo_muon.get_muon_scale_factor(o, i, mode=mode) for o, i in SCALE_SHAPES]
        out[f"scale.{mode}"] = torch.tensor(vals, dtype=torch.float32)
        meta["scale"]["values"][mode] = vals

    meta["muon"] = {}
    for case, nesterov in OPT_CASES.items():
        param0 = inputs[f"muon.{case}.param.0"]
        grads = [inputs[f"muon.{case}.grad.{k}"] for k in range(1, OPT_STEPS + 1)]
        params, moms = run_steps(lambda ps: eo_muon_optimizer(ps, nesterov), param0, grads)
        if megatron is not None:
            mparams, mmoms = run_steps(lambda ps: megatron.optimizer(ps, nesterov), param0, grads)
            for a, b in zip(params + moms, mparams + mmoms):
                assert torch.equal(a, b), f"muon.{case}: EO Muon and Megatron's TensorParallelMuon differ"
            params, moms = mparams, mmoms
        for k in range(1, OPT_STEPS + 1):
            out[f"muon.{case}.param.{k}"] = params[k - 1]
            out[f"muon.{case}.momentum.{k}"] = moms[k - 1]
        meta["muon"][f"muon.{case}"] = {"nesterov": nesterov}

    upd = inputs["qkv.update"]
    meta["qkv"] = {}
    for mode in QKV_SCALE_MODES:
        for split, name in ((True, f"qkv.{mode}"), (False, f"qkv.unsplit_{mode}")):
            res = eo_qkv(upd, mode, split)
            if megatron is not None:
                mres = megatron.qkv(upd, mode, split)
                assert torch.equal(res, mres), f"{name}: EO composition and TensorParallelMuon differ"
                res = mres
            out[name] = res
            meta["qkv"][name] = {"scale_mode": mode, "split_qkv": split}
    return out, meta


def polar_report(inputs, outputs, meta):
    """How far each Newton-Schulz output Y is from the polar factor U V^T of its input
    X = U S V^T (float64 SVD). In exact arithmetic Y = U f(S) V^T, f the composed scalar
    polynomial, so D = U^T Y V is diagonal: its diagonal is f at the singular values
    (signed: a negative value is a singular direction whose sign the iteration flipped)."""
    report = {}
    for name, info in meta["ns"].items():
        x = inputs[info["input"]].double()
        y = outputs[name].double()
        u, _, vh = torch.linalg.svd(x, full_matrices=False)
        d = u.T @ y @ vh.T
        f = torch.diagonal(d)
        report[name] = {"f_min": f.min().item(), "f_max": f.max().item(),
                        "max_abs_f_minus_1": (f - 1).abs().max().item(),
                        "max_abs_offdiag": (d - torch.diag(f)).abs().max().item(),
                        "max_abs_diff_polar": (y - u @ vh).abs().max().item()}
    return report


# ---------------------------------------------------------------------------------------


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def git_head(path):
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def eo_info():
    root = os.path.dirname(os.path.abspath(emerging_optimizers.__file__))
    files = ["orthogonalized_optimizers/muon_utils.py", "orthogonalized_optimizers/muon.py",
             "orthogonalized_optimizers/orthogonalized_optimizer.py", "mixin.py", "utils/__init__.py"]
    return {f: sha256(os.path.join(root, f)) for f in files}


def setup():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("highest")
    if emerging_optimizers.__version__ != EXPECTED_EO_VERSION:
        print(f"warning: emerging_optimizers {emerging_optimizers.__version__}, "
              f"the file is made with {EXPECTED_EO_VERSION}")


def build(path, seed, megatron):
    inputs = make_inputs(seed)
    outputs, cases = compute(inputs, megatron)
    report = polar_report(inputs, outputs, cases)
    for name in cases["ns"]:
        cases["ns"][name]["polar_check"] = report[name]
    coeff = {t: {"sets": [list(s) for s in muon_utils._COEFFICIENT_SETS[t]],
                 "iteration_rule": cases["iteration_rule"].get(t, "cycle")} for t in COEFF_TYPES}
    eps = inspect.signature(muon_utils.newton_schulz).parameters["eps"].default
    settings = {
        "ns": {"shapes": {k: list(v) for k, v in NS_SHAPES.items()},
               "illcond_singular_values": f"logspace from {ILLCOND_SV[0]} to {ILLCOND_SV[1]} "
                                          f"over min(rows, cols) values; U, V from QR of "
                                          f"float64 normals; stored as float32",
               "normalize_eps": eps, "transpose": "rows > cols",
               "step": "A = X X^T; B = b A + c A A; X = a X + B X",
               "cases": cases["ns"]},
        "scale": cases["scale"],
        "muon": {"settings": OPT, "param_shape": list(PARAM_SHAPE), "steps": OPT_STEPS,
                 "param_std": PARAM_STD, "cases": cases["muon"],
                 "step": "p *= 1 - lr wd; buf = lerp(buf, g, 1 - momentum); "
                         "u = nesterov ? lerp(g, buf, momentum) : buf; "
                         "p -= lr * extra * scale(rows, cols) * NS(u)"},
        "qkv": {**QKV, "split_shapes": qkv_split_shapes(), "shape": list(qkv_shape()),
                "settings": {k: OPT[k] for k in ("coefficient_type", "num_ns_steps",
                                                 "extra_scale_factor", "fp32_matmul_prec")},
                "cases": cases["qkv"]},
    }
    metadata = {
        "format": "see docs/golden.md (muon_golden) and tools/make_muon_golden.py",
        "torch_version": torch.__version__,
        "emerging_optimizers_version": emerging_optimizers.__version__,
        "emerging_optimizers_sha256": json.dumps(eo_info(), sort_keys=True),
        "python_version": platform.python_version(),
        "megatron": json.dumps(megatron.info if megatron else None, sort_keys=True),
        "optimizer_source": "megatron TensorParallelMuon (asserted equal to emerging_optimizers Muon)"
                            if megatron else "emerging_optimizers Muon",
        "seed": str(seed),
        "compute_dtype": "float32",
        "float32_matmul_precision": "highest",
        "coefficient_sets": json.dumps(coeff, sort_keys=True),
        "cases": json.dumps(settings, sort_keys=True),
    }
    tensors = {**inputs, **outputs}
    tensors = {k: v.contiguous() for k, v in sorted(tensors.items())}
    save_file(tensors, path, metadata=metadata)
    size = os.path.getsize(path)
    assert size < MAX_BYTES, size
    print(f"{path}: {len(tensors)} tensors, {size} bytes")


def check(path, megatron):
    stored = load_file(path)
    with safe_open(path, "pt") as f:
        md = f.metadata()
    seed = int(md["seed"])
    if md["emerging_optimizers_version"] != emerging_optimizers.__version__:
        print(f"warning: file made with emerging_optimizers {md['emerging_optimizers_version']}, "
              f"checking with {emerging_optimizers.__version__}")
    if md["torch_version"] != torch.__version__:
        print(f"warning: file made with torch {md['torch_version']}, checking with {torch.__version__}")
    inputs = make_inputs(seed)
    for k, v in inputs.items():
        assert torch.equal(stored[k], v), f"{k}: the seed no longer gives the stored input"
    outputs, _ = compute({k: stored[k] for k in inputs}, megatron)
    assert set(stored) == set(inputs) | set(outputs), set(stored) ^ (set(inputs) | set(outputs))
    for k, v in outputs.items():
        if not torch.equal(stored[k], v):
            diff = (stored[k].double() - v.double()).abs().max().item()
            raise SystemExit(f"error: {k} differs from the recomputed value (max abs {diff:.3g})")
    # Consistency of the file's own layout.
    cases = json.loads(md["cases"])
    for name, info in cases["ns"]["cases"].items():
        assert stored[name].shape == stored[info["input"]].shape, name
    print(f"{path}: {len(outputs)} outputs recomputed bit for bit from {len(inputs)} inputs "
          f"(optimizer source: {'megatron TensorParallelMuon + EO Muon' if megatron else 'EO Muon'})")
    report = polar_report(stored, stored, {"ns": cases["ns"]["cases"]})
    print("Y = NS(X) against the polar factor U V^T of X = U S V^T (float64 SVD); f = diag(U^T Y V):")
    print(f"  {'case':30s} {'f min':>8s} {'f max':>8s} {'max|f-1|':>9s} {'offdiag':>8s} {'max|Y-UV^T|':>11s}")
    for name, r in report.items():
        print(f"  {name:30s} {r['f_min']:8.4f} {r['f_max']:8.4f} {r['max_abs_f_minus_1']:9.3g} "
              f"{r['max_abs_offdiag']:8.2g} {r['max_abs_diff_polar']:11.3g}")
    # Loose: Y = U f(S) V^T up to rounding, and the well-conditioned inputs after 5 or more
    # steps land in a band around 1, except "aol", whose fifth step (the list of 4 cycled
    # back to its first set) sends values near 1 to about -0.6 (docs/golden.md).
    for name, r in report.items():
        info = cases["ns"]["cases"][name]
        assert r["max_abs_offdiag"] < 1e-4, (name, r)
        if not name.endswith("illcond") and info["steps"] >= 5 and info["coefficient_type"] != "aol":
            assert 0.5 < r["f_min"] and r["f_max"] < 1.5, (name, r)
    worst = replay_fp64(stored, cases)
    print("float64 replay from the metadata alone, worst |replay - stored|:")
    for k, v in worst.items():
        print(f"  {k:20s} {v:.3g}")
        assert v < 1e-3, (k, v)


def replay_fp64(stored, cases):
    """Replays the file from its metadata alone, in float64: the recurrences a C++ test
    implements. Returns the worst absolute difference from the stored float32 outputs per
    group (a guide to tolerances; only a loose bound is asserted)."""
    def ns64(x, coefficients, eps):
        x = x.double()
        tr = x.shape[0] > x.shape[1]
        x = x.T if tr else x
        X = x / max(torch.linalg.norm(x).item(), eps)
        for a, b, c in coefficients:
            A = X @ X.T
            X = a * X + (b * A + c * A @ A) @ X
        return X.T if tr else X

    def scale(o, i, mode):
        return {"spectral": max(o, i) ** 0.5, "unit_rms_norm": (o / i) ** 0.5,
                "shape_scaling": max(1, o / i) ** 0.5}[mode]

    def diff(a, b):
        return (a.double() - b.double()).abs().max().item()

    eps = cases["ns"]["normalize_eps"]
    worst = {}
    for name, info in cases["ns"]["cases"].items():
        key = f"ns.{info['coefficient_type']}"
        worst[key] = max(worst.get(key, 0.0),
                         diff(ns64(stored[info["input"]], info["coefficients"], eps), stored[name]))
    quintic = [info for info in cases["ns"]["cases"].values()
               if info["coefficient_type"] == "quintic" and info["steps"] == 5][0]["coefficients"]
    for (o, i), mode_vals in zip(cases["scale"]["shapes"], zip(*cases["scale"]["values"].values())):
        for mode, v in zip(cases["scale"]["values"], mode_vals):
            assert v == scale(o, i, mode), (o, i, mode, v)
    s = cases["muon"]["settings"]
    assert s["coefficient_type"] == "quintic" and s["num_ns_steps"] == 5
    for case, info in cases["muon"]["cases"].items():
        p = stored[f"{case}.param.0"].double()
        buf = torch.zeros_like(p)
        for k in range(1, cases["muon"]["steps"] + 1):
            g = stored[f"{case}.grad.{k}"].double()
            p = p * (1 - s["lr"] * s["weight_decay"])
            buf = s["momentum"] * buf + (1 - s["momentum"]) * g
            u = (1 - s["momentum"]) * g + s["momentum"] * buf if info["nesterov"] else buf
            p = p - s["lr"] * s["extra_scale_factor"] * scale(*p.shape, s["scale_mode"]) * ns64(u, quintic, eps)
            worst["muon.param"] = max(worst.get("muon.param", 0.0), diff(p, stored[f"{case}.param.{k}"]))
            worst["muon.momentum"] = max(worst.get("muon.momentum", 0.0),
                                         diff(buf, stored[f"{case}.momentum.{k}"]))
    q = cases["qkv"]
    upd = stored["qkv.update"].double()
    for name, info in q["cases"].items():
        pieces = ([upd.view(q["num_query_groups"], -1, q["hidden"])[:, a:a + n].reshape(-1, q["hidden"])
                   for a, n in zip([0, q["split_shapes"][0], sum(q["split_shapes"][:2])], q["split_shapes"])]
                  if info["split_qkv"] else [upd])
        outs = [q["settings"]["extra_scale_factor"] * scale(*x.shape, info["scale_mode"]) * ns64(x, quintic, eps)
                for x in pieces]
        if info["split_qkv"]:
            res = torch.cat([o.view(q["num_query_groups"], -1, q["hidden"]) for o in outs], 1).view(upd.shape)
        else:
            res = outs[0]
        worst["qkv"] = max(worst.get("qkv", 0.0), diff(res, stored[name]))
    return worst


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(root, "tests", "golden", FILE))
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--check-only", action="store_true", help="only re-check the existing file")
    ap.add_argument("--megatron", default=None,
                    help="a Megatron-LM checkout: run the optimizer and QKV cases through its "
                         "TensorParallelMuon too (and assert the same bits)")
    ap.add_argument("--megatron-commit", default=None,
                    help="recorded in the metadata (default: git rev-parse HEAD in --megatron)")
    args = ap.parse_args()
    setup()
    megatron = MegatronMuon(args.megatron, args.megatron_commit) if args.megatron else None
    if not args.check_only:
        build(args.out, args.seed, megatron)
    check(args.out, megatron)
    return 0


if __name__ == "__main__":
    sys.exit(main())
