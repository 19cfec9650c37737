#!/usr/bin/env python3
"""Checks `megaton convert --to hf` output with Hugging Face transformers.

Two modes:

    # Everything, on the golden models (tests/golden/*_tiny.safetensors, docs/golden.md):
    # each golden's weights and config as a Hugging Face directory -> megaton convert
    # --from hf (one rank, and a TP2 x EP2 target) -> megaton convert --to hf (fp32 and
    # bf16) -> AutoModelForCausalLM.from_pretrained, then: no missing / unexpected keys,
    # every fp32 tensor equal to the golden's, the logits of the golden's tokens against
    # the golden logits (relative norm error <= 1e-4 in fp32, <= 2e-2 from bf16 weights).
    python3 tools/check_hf_export.py --megaton build/megaton [--device cuda]

    # One exported directory: prints the logits of the token sequence (the golden's
    # input.tokens with --golden, else --tokens) and compares them with the golden's logits
    # and its weights.
    python3 tools/check_hf_export.py EXPORT_DIR [--golden tests/golden/llama_tiny.safetensors]

Needs torch, transformers and safetensors (no internet). Exits 1 when a check fails.
Megaton's own logits are not dumped by any command; the golden logits stand for them: the
golden parity tests (tests/golden/test_golden.cpp) hold Megaton's logits of these weights
to the same ones within 1e-4, so a round trip that keeps the weights must keep them too.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDENS = ["llama_tiny", "mixtral_tiny", "qwen3_moe_tiny", "deepseek_v3_tiny", "nemotron_h_tiny"]


def read_golden(path):
    """(config dict, {HF name: tensor} of the weights, tokens [B, S], logits [B, S, V])."""
    with safe_open(path, "pt") as f:
        config = json.loads(f.metadata()["config"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    weights = {k: v for k, v in tensors.items() if k.split(".")[0] not in ("grad", "input", "output")}
    return config, weights, tensors["input.tokens"].long(), tensors["output.logits"]


def write_hf_dir(golden_path, out_dir):
    """The golden's weights and config as a Hugging Face model directory."""
    config, weights, _, _ = read_golden(golden_path)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def load_model(export_dir, device):
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            export_dir, experts_implementation="eager", **kwargs)
    except TypeError:  # transformers without experts_implementation
        kwargs["torch_dtype"] = kwargs.pop("dtype")
        model, info = AutoModelForCausalLM.from_pretrained(export_dir, **kwargs)
    return model.to(device).eval(), info


def rel_error(a, b):
    return (a.double() - b.double()).norm().item() / b.double().norm().item()


def check_dir(export_dir, golden_path, tokens_arg, device, logits_tol, exact_weights,
              print_logits=True):
    """Loads one exported directory; returns the list of failures."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failures = []
    model, info = load_model(export_dir, device)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(key):
            failures.append(f"{export_dir}: {key} {sorted(info[key])[:8]}")
    golden = read_golden(golden_path) if golden_path else None
    if golden:
        tokens, want = golden[2], golden[3]
    else:
        vocab = model.config.vocab_size
        tokens = torch.tensor([tokens_arg], dtype=torch.long) % vocab
        want = None
    with torch.no_grad():
        logits = model(tokens.to(device)).logits.float().cpu()
    if print_logits:
        torch.set_printoptions(precision=6, linewidth=120)
        print(f"{export_dir}: logits {list(logits.shape)} of tokens {tokens.tolist()} "
              f"(first sequence, first 8 vocabulary entries shown)")
        print(logits[0, :, :8])
    if want is not None:
        err = rel_error(logits, want)
        verdict = "ok" if err <= logits_tol else "FAIL"
        print(f"{export_dir}: logits vs {os.path.basename(golden_path)}: relative error "
              f"{err:.2e} (<= {logits_tol:g}) {verdict}")
        if err > logits_tol:
            failures.append(f"{export_dir}: logits relative error {err:.2e} > {logits_tol:g}")
    if golden and exact_weights:
        from safetensors.torch import load_file

        exported = {}
        for name in sorted(os.listdir(export_dir)):
            if name.endswith(".safetensors"):
                exported.update(load_file(os.path.join(export_dir, name)))
        weights = golden[1]
        if set(exported) != set(weights):
            failures.append(f"{export_dir}: tensor names differ from the golden's: only exported "
                            f"{sorted(set(exported) - set(weights))[:5]}, only golden "
                            f"{sorted(set(weights) - set(exported))[:5]}")
        differing = [k for k in sorted(set(exported) & set(weights))
                     if exported[k].dtype != weights[k].dtype or not torch.equal(exported[k], weights[k])]
        if differing:
            failures.append(f"{export_dir}: {len(differing)} tensors differ from the golden's, "
                            f"e.g. {differing[:5]}")
        else:
            print(f"{export_dir}: all {len(exported)} tensors equal the golden's")
    return failures


def run(cmd):
    print("+ " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def check_all(megaton, device, models):
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            golden = os.path.join(ROOT, "tests", "golden", name + ".safetensors")
            hf_dir = os.path.join(tmp, name + "_hf")
            write_hf_dir(golden, hf_dir)
            moe = name != "llama_tiny"
            # One rank, and a TP2 (x EP2 for MoE) layout: both must export the same weights.
            targets = {"tp1": []}
            targets["tp2"] = ["--target-tensor-model-parallel-size", "2"] + (
                ["--target-expert-model-parallel-size", "2"] if moe else [])
            for tag, target in targets.items():
                ckpt = os.path.join(tmp, f"{name}_{tag}_ckpt")
                run([megaton, "convert", "--from", "hf", hf_dir, "--save", ckpt,
                     "--make-vocab-size-divisible-by", "1"] + target)
                for dtype, tol in (("fp32", 1e-4), ("bf16", 2e-2)):
                    out = os.path.join(tmp, f"{name}_{tag}_{dtype}")
                    run([megaton, "convert", "--load", ckpt, "--to", "hf", out,
                         "--export-dtype", dtype])
                    failures += check_dir(out, golden, None, device, tol, dtype == "fp32",
                                          print_logits=False)
    return failures


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export_dir", nargs="?", help="a directory megaton convert --to hf wrote")
    p.add_argument("--golden", help="a tests/golden/*_tiny.safetensors file to compare with")
    p.add_argument("--tokens", default="1,5,9,13,17,21,25,29", help="token ids without --golden")
    p.add_argument("--megaton", help="the megaton binary: run the whole round trip on the goldens")
    p.add_argument("--models", default=",".join(GOLDENS), help="goldens for --megaton")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--logits-tol", type=float, default=1e-4)
    a = p.parse_args()
    if a.megaton:
        failures = check_all(a.megaton, a.device, a.models.split(","))
    elif a.export_dir:
        failures = check_dir(a.export_dir, a.golden, [int(t) for t in a.tokens.split(",")],
                             a.device, a.logits_tol, a.golden is not None)
    else:
        p.error("give EXPORT_DIR or --megaton")
    for f in failures:
        print("FAIL: " + f)
    print("check_hf_export: " + ("FAILED" if failures else "all checks passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
