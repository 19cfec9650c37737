#!/usr/bin/env python3
"""Golden reference data for Megaton's model-parity tests, from Hugging Face transformers.

Writes tests/golden/llama_tiny.safetensors, tests/golden/mixtral_tiny.safetensors and
tests/golden/qwen3_moe_tiny.safetensors: a tiny LlamaForCausalLM (GQA), a tiny
MixtralForCausalLM (top-2 of 4 experts) and a tiny Qwen3MoeForCausalLM (per-head q/k
RMSNorm, head_dim 32 != hidden / heads, top-2 of 4 experts renormalised) with seeded
random weights, one batch of random tokens and labels, the logits, the loss and the
gradient of every parameter. docs/golden.md describes the contents; run

    pip install -r tools/requirements-golden.txt
    python tools/make_golden.py            # writes tests/golden/*.safetensors
    python tools/make_golden.py --models qwen3_moe   # only that file

Numerics: weights are drawn in float32 and stored as F32 (exactly); the forward and the
backward run in float64 on those same values, and the results are rounded to F32 when
saved. transformers casts to float32 in a few places whatever the model dtype (RMSNorm,
RoPE angles, the attention softmax, the MoE router softmax); the reference runs under
Float64Everywhere, which turns every float32 request into float64, and with the RoPE
inverse frequencies recomputed in float64, so the whole computation is float64. check()
then confirms the stock float32-island model gives the same logits to ~1e-6, and the
stored gradients against central differences of the float64 loss.

Parameter names are the checkpoint names that save_pretrained writes (for Mixtral:
block_sparse_moe.gate and block_sparse_moe.experts.<e>.w1/w2/w3, the names of the
published Mixtral checkpoints; for Qwen3-MoE: mlp.gate and
mlp.experts.<e>.gate_proj/up_proj/down_proj), not the fused in-memory layout of
transformers 5.
"""

import argparse
import os
import re
import sys
import tempfile

import torch
import transformers
from torch.overrides import TorchFunctionMode
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

BATCH, SEQ = 2, 16
SEED = 1234
# MoE routing must not hinge on a near-tie: an fp32 implementation has to pick the
# same top-2 experts as this fp64 reference for every token and layer. Its routing probs
# differ from these by ~1e-6 at most; the margin keeps a factor of 100 above that. Seeds
# seed, seed + 1, ... are tried until one gives the margin.
MIN_ROUTER_MARGIN = 1e-4
MAX_SEED_TRIES = 100

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_dropout=0.0,
    pad_token_id=None,  # a padding_idx would zero that embedding row's gradient
    bos_token_id=1,
    eos_token_id=2,
)


def llama_config():
    return LlamaConfig(intermediate_size=96, attention_bias=False, mlp_bias=False, **COMMON)


def mixtral_config():
    return MixtralConfig(
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
        router_jitter_noise=0.0,
        sliding_window=None,
        **COMMON,
    )


def qwen3_moe_config():
    """Qwen3-MoE: q_norm / k_norm on each head, head_dim 32 (query width 128 != hidden 64),
    every layer MoE, softmax router with the top-k renormalised (norm_topk_prob), no
    shared expert, no attention bias."""
    return Qwen3MoeConfig(
        head_dim=32,
        intermediate_size=96,  # unused: no dense layer
        moe_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        attention_bias=False,
        use_sliding_window=False,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
        **COMMON,
    )


MOE_CLASSES = (MixtralForCausalLM, Qwen3MoeForCausalLM)


class Float64Everywhere(TorchFunctionMode):
    """Every float32 dtype asked for inside (x.float(), x.to(torch.float32),
    softmax(..., dtype=torch.float32)) becomes float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: (torch.float64 if v is torch.float32 else v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def rope_inv_freq_fp64(model):
    """Recompute the RoPE inverse frequencies (built in float32 at construction) in
    float64: inv_freq[i] = theta^(-2i / head_dim)."""
    rotary = model.model.rotary_emb
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    assert torch.allclose(rotary.inv_freq.double(), inv_freq, rtol=1e-6)
    assert rotary.attention_scaling == 1.0
    rotary.inv_freq = inv_freq
    rotary.original_inv_freq = inv_freq.clone()


def build(model_class, config, seed):
    """The model in float64 with float32-representable weights drawn from `seed`."""
    kwargs = dict(attn_implementation="eager")
    if model_class in MOE_CLASSES:
        kwargs["experts_implementation"] = "eager"  # the plain per-expert loop
    model = model_class._from_config(config, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            # RMSNorm weights (q_norm / k_norm too) around 1 so that they are exercised.
            value = 1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.02 * noise
            p.copy_(value)
    model = model.to(torch.float64)
    rope_inv_freq_fp64(model)
    model.train()  # dropout is 0; train() only matters for router jitter, which is 0
    return model


def checkpoint_names(model, tensors):
    """`tensors` keyed by in-memory names -> keyed by the names save_pretrained writes."""
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, dict(tensors))
    assert sum(t.numel() for t in out.values()) == sum(t.numel() for t in tensors.values())
    return out


def router_margin(model, tokens):
    """Smallest gap between the k-th and (k+1)-th router probability over tokens/layers."""
    margins = []

    def hook(module, inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        probs = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(probs, module.top_k + 1, dim=-1).values
        margins.append((top[:, module.top_k - 1] - top[:, module.top_k]).min().item())

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    with torch.no_grad(), Float64Everywhere():
        model(input_ids=tokens)
    for h in handles:
        h.remove()
    return min(margins)


def model_and_batch(model_class, config, seed):
    model = build(model_class, config, seed)
    gen = torch.Generator().manual_seed(seed + 1_000_000)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
    return model, tokens, labels


def make(model_class, config, seed, path):
    extra = {}
    if model_class in MOE_CLASSES:
        for seed in range(seed, seed + MAX_SEED_TRIES):
            model, tokens, labels = model_and_batch(model_class, config, seed)
            margin = router_margin(model, tokens)
            if margin >= MIN_ROUTER_MARGIN:
                break
        else:
            raise SystemExit(f"{path}: no seed gave a router top-k margin >= {MIN_ROUTER_MARGIN}")
        extra["min_router_topk_margin"] = f"{margin:.6g}"
    else:
        model, tokens, labels = model_and_batch(model_class, config, seed)

    # Loss straight from the logits: mean over all B*S positions of the cross entropy of
    # logits[b, s] against labels[b, s] (no shift; HF's own loss would shift by one).
    model.zero_grad(set_to_none=True)
    with Float64Everywhere():
        logits = model(input_ids=tokens, use_cache=False).logits
        assert logits.dtype == torch.float64 and logits.shape == (BATCH, SEQ, config.vocab_size)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, config.vocab_size), labels.reshape(-1), reduction="mean"
        )
        loss.backward()

    params = {n: p.detach() for n, p in model.named_parameters()}
    grads = {n: p.grad.detach() for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    params = checkpoint_names(model, params)
    grads = checkpoint_names(model, grads)

    out = {}
    for name, p in params.items():
        w = p.to(torch.float32)
        assert torch.equal(w.to(torch.float64), p), f"{name} is not float32-representable"
        out[name] = w.contiguous()
    for name, g in grads.items():
        out["grad." + name] = g.to(torch.float32).contiguous()
    out["input.tokens"] = tokens.to(torch.int32)
    out["input.labels"] = labels.to(torch.int32)
    out["output.logits"] = logits.detach().to(torch.float32)
    out["output.loss"] = loss.detach().to(torch.float32).reshape(1)

    metadata = {
        "config": config.to_json_string(use_diff=False),
        "model_class": model_class.__name__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "seed": str(seed),
        "compute_dtype": "float64",
        "loss": "mean over all batch*seq positions of cross_entropy(logits[b,s], labels[b,s]), "
                "no shift",
        "loss_fp64": repr(loss.item()),
        **extra,
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_file(out, path, metadata=metadata)
    print(f"{path}: {len(out)} tensors, {os.path.getsize(path)} bytes, loss {loss.item():.10f}"
          + f", seed {seed}"
          + (f", router margin {extra['min_router_topk_margin']}" if extra else ""))


def in_memory_view(model, name):
    """The model's tensor (or a view of it) holding checkpoint parameter `name`. Written
    by hand from the published Mixtral and Qwen3-MoE layouts: gate_up_proj[e] = [w1; w3]
    = [gate_proj; up_proj], down_proj[e] = w2 = down_proj; an independent check of the
    names revert_weight_conversion produced."""
    m = re.fullmatch(r"(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w[123]|gate_proj|up_proj|down_proj)\.weight", name)
    if m:
        experts = model.get_submodule(m.group(1) + ".mlp.experts")
        e, inter = int(m.group(2)), experts.intermediate_dim
        gate, up = experts.gate_up_proj[e, :inter], experts.gate_up_proj[e, inter:]
        return {"w1": gate, "w3": up, "w2": experts.down_proj[e], "gate_proj": gate,
                "up_proj": up, "down_proj": experts.down_proj[e]}[m.group(3)]
    return model.get_parameter(name.replace(".block_sparse_moe.", ".mlp."))


def check(model_class, path, elements_per_param=3):
    """Reloads `path` through from_pretrained (HF's own checkpoint-name conversion) in
    float64 and checks the stored logits, loss and, by central differences, some elements
    of every stored gradient."""
    data = load_file(path)
    params = {k: v for k, v in data.items() if not k.startswith(("grad.", "input.", "output."))}
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        config_json = f.metadata()["config"]
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(config_json)
        save_file(params, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        kwargs = dict(dtype=torch.float64, attn_implementation="eager")
        if model_class in MOE_CLASSES:
            kwargs["experts_implementation"] = "eager"
        model = model_class.from_pretrained(tmp, **kwargs)
    model.train()
    tokens, labels = data["input.tokens"].long(), data["input.labels"].long()
    with torch.no_grad():  # stock transformers, float32 islands included
        stock = model(input_ids=tokens, use_cache=False).logits.float()
    stock_err = ((stock - data["output.logits"]).norm() / data["output.logits"].norm()).item()
    assert stock_err < 1e-5, f"stock transformers logits differ by {stock_err}"
    rope_inv_freq_fp64(model)
    for name, value in params.items():
        assert torch.equal(in_memory_view(model, name).to(torch.float32), value), name
    assert len(params) == len([n for n in data if n.startswith("grad.")])

    def loss_fn():
        with Float64Everywhere():
            logits = model(input_ids=tokens, use_cache=False).logits
            return logits, torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    with torch.no_grad():
        logits, loss = loss_fn()
        assert torch.allclose(logits.float(), data["output.logits"], rtol=1e-6, atol=1e-7)
        assert abs(loss.item() - data["output.loss"].item()) <= 1e-6 * loss.item()
        gen = torch.Generator().manual_seed(0)
        h, worst = 1e-6, 0.0  # float64: truncation ~h^2, rounding ~1e-16 / h
        for name in params:
            view, grad = in_memory_view(model, name), data["grad." + name]
            for i in torch.randint(0, grad.numel(), (elements_per_param,), generator=gen):
                idx = tuple(int(j) for j in torch.unravel_index(i, grad.shape))
                orig = view[idx].item()
                view[idx] = orig + h
                plus = loss_fn()[1].item()
                view[idx] = orig - h
                minus = loss_fn()[1].item()
                view[idx] = orig
                fd, g = (plus - minus) / (2 * h), grad[idx].item()
                err = abs(fd - g)
                assert abs(fd - g) <= 1e-9 + 1e-6 * abs(g), f"{name}{list(idx)}: fd {fd} vs {g}"
                worst = max(worst, err)
    print(f"{path}: reloaded with from_pretrained; stock logits agree to {stock_err:.1e} "
          f"(relative); logits, loss and {elements_per_param} finite-difference gradient "
          f"elements per parameter agree (worst |fd - grad| {worst:.1e})")


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=os.path.join(root, "tests", "golden"))
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--check-only", action="store_true",
                    help="only re-check the existing files against transformers")
    models = {
        "llama": (LlamaForCausalLM, llama_config, "llama_tiny.safetensors"),
        "mixtral": (MixtralForCausalLM, mixtral_config, "mixtral_tiny.safetensors"),
        "qwen3_moe": (Qwen3MoeForCausalLM, qwen3_moe_config, "qwen3_moe_tiny.safetensors"),
    }
    ap.add_argument("--models", nargs="+", choices=list(models), default=list(models),
                    help="which files to write and check (default: all)")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    for key in args.models:
        model_class, make_config, file = models[key]
        config = make_config()
        path = os.path.join(args.out_dir, file)
        if not args.check_only:
            make(model_class, config, args.seed, path)
        check(model_class, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
