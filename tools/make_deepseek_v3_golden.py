#!/usr/bin/env python3
"""Golden reference data for Megaton's DeepSeek-V3 parity test, from Hugging Face transformers.

Writes tests/golden/deepseek_v3_tiny.safetensors: a tiny DeepseekV3ForCausalLM (multi-latent
attention with q and kv LoRA, YaRN RoPE on the decoupled rope dims, one dense layer then two
MoE layers with a shared expert and a group-limited sigmoid router with expert bias) with
seeded random weights, one batch of random tokens and labels, the logits, the loss and the
gradient of every parameter, in the layout of tools/make_golden.py's files (docs/golden.md).
Run

    pip install -r tools/requirements-golden.txt
    python tools/make_deepseek_v3_golden.py              # writes, then checks
    python tools/make_deepseek_v3_golden.py --check-only

Numerics as tools/make_golden.py: weights drawn in float32 and stored exactly; forward and
backward in float64 under Float64Everywhere, with the YaRN inverse frequencies recomputed in
float64 (transformers builds them in float32); check() reloads the file through
from_pretrained, compares the stock (float32-island) logits, and confirms the stored
gradients against central differences of the float64 loss.

Choices that make the test catch something:
- mscale 1.0 != mscale_all_dim 0.707: the cos/sin factor is then not 1 and the softmax scale
  uses mscale_all_dim, not mscale (Megatron-LM issue #1429 used mscale);
- original_max_position_embeddings 64 with rope dim 8: YaRN's ramp is [0, 0.5, 1, 1], so
  extrapolated, blended and interpolated frequencies all occur;
- v_head_dim 12 != qk_nope_head_dim 16, q_lora_rank 24 != kv_lora_rank 16;
- 16 experts in 4 groups of 4, 2 groups kept, top-4: HF scores a group by the sum of its
  best 2 selection scores whatever the top-k, Megatron by its best topk / group_topk, so
  top-k = 2 x topk_group makes the two agree (tools/make_router_hf_golden.py); groups of 4
  make the choice inside a group matter too;
- e_score_correction_bias random, large enough that it changes some tokens' experts, and
  the group limit changes some tokens' experts too (checked).
The expert choice must not hinge on a near-tie: seeds are tried until every group choice
and every expert choice is decided by at least MIN_ROUTER_MARGIN in selection score.
"""

import argparse
import json
import math
import os
import sys
import tempfile

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import (  # noqa: E402  (the shared methodology)
    BATCH,
    MAX_SEED_TRIES,
    MIN_ROUTER_MARGIN,
    SEED,
    SEQ,
    Float64Everywhere,
    checkpoint_names,
    in_memory_view,
)

FILE = "deepseek_v3_tiny.safetensors"
# The expert bias: N(0, BIAS_STD), about the spread of the sigmoid scores (router weights
# std 0.02 on RMS-normalised hidden states of norm ~8: logits std ~0.16, scores std ~0.04).
BIAS_STD = 0.03


def deepseek_v3_config():
    return DeepseekV3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=40,  # dense layer 0 (Megaton --ffn-hidden-size)
        moe_intermediate_size=20,
        num_hidden_layers=3,
        first_k_dense_replace=1,  # layer 0 dense, layers 1-2 MoE
        num_attention_heads=4,
        num_key_value_heads=4,  # eager attention repeats k/v by heads / this: must be 1x
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        hidden_act="silu",
        max_position_embeddings=256,  # = factor x original_max_position_embeddings
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
        rope_interleave=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        attention_dropout=0.0,
        num_mtp_layers=0,  # DeepseekV3ForCausalLM builds no MTP module either way
        pad_token_id=None,  # a padding_idx would zero that embedding row's gradient
        bos_token_id=1,
        eos_token_id=2,
    )


def get_mscale(factor, m=1.0):
    """YaRN's attention temperature (DeepSeek's yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_fp64(cfg):
    """YaRN in float64, from the YaRN paper's definitions as transformers' and Megatron's
    docs describe them (docs/research/deepseek-v3.md 2.1-2.3): the dim / 2 inverse
    frequencies, the cos/sin factor, the softmax scale, and the ramp."""
    rp = cfg.rope_parameters
    dim, base, factor = cfg.qk_rope_head_dim, rp["rope_theta"], rp["factor"]
    l0 = rp["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(l0 / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rp["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(rp["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    i = torch.arange(dim // 2, dtype=torch.float64)
    ramp = ((i - low) / (high - low)).clamp(0, 1)  # 1: interpolated (divided by factor)
    extra = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv_freq = extra * (1 - ramp) + extra / factor * ramp
    cos_sin = get_mscale(factor, rp["mscale"]) / get_mscale(factor, rp["mscale_all_dim"])
    softmax = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * get_mscale(
        factor, rp["mscale_all_dim"]) ** 2
    return dict(inv_freq=inv_freq, cos_sin_scale=cos_sin, softmax_scale=softmax, ramp=ramp,
                low=low, high=high)


def yarn_to_fp64(model):
    """Replaces the float32 YaRN inverse frequencies with float64 ones, after checking that
    transformers' own values (frequencies, cos/sin factor, softmax scale) are those of
    yarn_fp64."""
    y = yarn_fp64(model.config)
    rotary = model.model.rotary_emb
    assert torch.allclose(rotary.inv_freq.double(), y["inv_freq"], rtol=1e-6, atol=0)
    assert abs(rotary.attention_scaling - y["cos_sin_scale"]) <= 1e-12
    for layer in model.model.layers:
        assert abs(layer.self_attn.scaling - y["softmax_scale"]) <= 1e-12
    rotary.inv_freq = y["inv_freq"].clone()
    rotary.original_inv_freq = y["inv_freq"].clone()
    return y


def build(config, seed):
    """The model in float64 with float32-representable weights and expert biases drawn from
    `seed`."""
    model = DeepseekV3ForCausalLM._from_config(
        config, attn_implementation="eager", experts_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            # RMSNorm weights (q_a_layernorm, kv_a_layernorm too) around 1 so they matter.
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.02 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(BIAS_STD * torch.randn(b.shape, generator=gen, dtype=torch.float32))
    model = model.to(torch.float64)
    yarn_to_fp64(model)
    model.train()  # dropout is 0
    return model


def kth_gap(values, k):
    """Per row, the gap between the k-th and (k+1)-th largest value."""
    top = torch.topk(values, k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


def row_sets(indices):
    return [frozenset(r) for r in indices.tolist()]


def routing_report(model, tokens):
    """For every MoE layer, recomputes DeepseekV3TopkRouter's choice in float64 from the
    router logits the model produced and returns the smallest group margin (gap between the
    topk_group-th and next group score), the smallest expert margin (gap between the k-th
    and next selection score among the kept groups), and whether the expert bias and the
    group limit each change at least one token's experts. Asserts that the recomputed
    choice is transformers'."""
    cfg = model.config
    E, G, g, k = cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
    report = dict(group_margin=math.inf, expert_margin=math.inf, bias_matters=False,
                  groups_matter=False)

    def choose(sel):
        group = sel.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group).scatter_(1, group.topk(g, dim=-1).indices, 1.0)
        masked = sel.masked_fill(keep.repeat_interleave(E // G, dim=1) == 0, float("-inf"))
        return group, masked, masked.topk(k, dim=-1).indices

    def hook(module, inputs, output):
        logits, _, indices = output
        scores = logits.double().sigmoid()
        sel = scores + module.e_score_correction_bias.double()
        group, masked, chosen = choose(sel)
        assert row_sets(chosen) == row_sets(indices), "recomputed routing differs from HF's"
        report["group_margin"] = min(report["group_margin"], kth_gap(group, g).min().item())
        report["expert_margin"] = min(report["expert_margin"], kth_gap(masked, k).min().item())
        report["bias_matters"] |= row_sets(choose(scores)[2]) != row_sets(chosen)
        report["groups_matter"] |= row_sets(sel.topk(k, dim=-1).indices) != row_sets(chosen)

    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert len(gates) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    handles = [gate.register_forward_hook(hook) for gate in gates]
    with torch.no_grad(), Float64Everywhere():
        model(input_ids=tokens, use_cache=False)
    for h in handles:
        h.remove()
    return report


def model_and_batch(config, seed):
    model = build(config, seed)
    gen = torch.Generator().manual_seed(seed + 1_000_000)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
    return model, tokens, labels


def bias_names(model):
    return [n for n, _ in model.named_buffers() if n.endswith("e_score_correction_bias")]


def make(config, seed, path):
    for seed in range(seed, seed + MAX_SEED_TRIES):
        model, tokens, labels = model_and_batch(config, seed)
        r = routing_report(model, tokens)
        if (min(r["group_margin"], r["expert_margin"]) >= MIN_ROUTER_MARGIN
                and r["bias_matters"] and r["groups_matter"]):
            break
    else:
        raise SystemExit(f"{path}: no seed gave router margins >= {MIN_ROUTER_MARGIN} with the "
                         "expert bias and the group limit each changing a choice")

    # Loss straight from the logits (no shift), as tools/make_golden.py.
    model.zero_grad(set_to_none=True)
    with Float64Everywhere():
        logits = model(input_ids=tokens, use_cache=False).logits
        assert logits.dtype == torch.float64 and logits.shape == (BATCH, SEQ, config.vocab_size)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, config.vocab_size), labels.reshape(-1), reduction="mean")
        loss.backward()

    params = {n: p.detach() for n, p in model.named_parameters()}
    grads = {n: p.grad.detach() for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    params = checkpoint_names(model, params)
    grads = checkpoint_names(model, grads)
    # The expert bias is a buffer (no gradient): stored under its state_dict name.
    for name in bias_names(model):
        params[name] = model.get_buffer(name).detach()
    with tempfile.TemporaryDirectory() as tmp:  # the names save_pretrained writes
        model.save_pretrained(tmp)
        with safe_open(os.path.join(tmp, "model.safetensors"), "pt") as f:
            saved = set(f.keys())
    assert saved == set(params), sorted(saved ^ set(params))

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

    y = yarn_fp64(config)
    metadata = {
        "config": config.to_json_string(use_diff=False),
        "model_class": DeepseekV3ForCausalLM.__name__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "seed": str(seed),
        "compute_dtype": "float64",
        "loss": "mean over all batch*seq positions of cross_entropy(logits[b,s], labels[b,s]), "
                "no shift",
        "loss_fp64": repr(loss.item()),
        "min_router_group_margin": f"{r['group_margin']:.6g}",
        "min_router_topk_margin": f"{r['expert_margin']:.6g}",
        # yarn_fp64's values; yarn_to_fp64 checked them against transformers' (its float32
        # inverse frequencies to 1e-6, its cos/sin factor and softmax scale to 1e-12).
        "yarn": json.dumps({"inv_freq": y["inv_freq"].tolist(), "ramp": y["ramp"].tolist(),
                            "cos_sin_scale": y["cos_sin_scale"],
                            "softmax_scale": y["softmax_scale"]}),
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_file(out, path, metadata=metadata)
    print(f"{path}: {len(out)} tensors, {os.path.getsize(path)} bytes, loss {loss.item():.10f}, "
          f"seed {seed}, router margins: group {r['group_margin']:.3g}, "
          f"expert {r['expert_margin']:.3g}")


def check(path, elements_per_param=3):
    """Reloads `path` through from_pretrained in float64 and checks the stored logits, loss,
    routing margins and, by finite differences, some elements of every stored gradient.

    The difference is the five-point one, (f(-2h) - 8 f(-h) + 8 f(h) - f(2h)) / 12h with
    h = 1e-5 (truncation ~h^4): make_golden.py's central difference with h = 1e-6 sits at this
    model's rounding floor (the float64 loss is exact to ~1e-14, so ~1e-9 in the quotient)
    and missed its 1e-9 + 1e-6 |grad| bound by 4e-11 on one element. A step of at most 2h =
    2e-5 in one weight moves a selection score by ~2e-5 at most (a router weight times an
    RMS-normalised input of a few units, times sigmoid' <= 1/4), well inside the routing
    margins, so no expert choice changes (a change would show as a large mismatch)."""
    data = load_file(path)
    params = {k: v for k, v in data.items() if not k.startswith(("grad.", "input.", "output."))}
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(meta["config"])
        save_file(params, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        model = DeepseekV3ForCausalLM.from_pretrained(
            tmp, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager")
    model.train()
    tokens, labels = data["input.tokens"].long(), data["input.labels"].long()
    with torch.no_grad():  # stock transformers, float32 islands included
        stock = model(input_ids=tokens, use_cache=False).logits.float()
    stock_err = ((stock - data["output.logits"]).norm() / data["output.logits"].norm()).item()
    assert stock_err < 1e-5, f"stock transformers logits differ by {stock_err}"
    yarn_to_fp64(model)
    biases = set(bias_names(model))
    for name, value in params.items():
        held = model.get_buffer(name) if name in biases else in_memory_view(model, name)
        assert torch.equal(held.to(torch.float32), value), name
    assert biases <= set(params)
    assert not any(("grad." + b) in data for b in biases)
    trained = [n for n in params if n not in biases]
    assert len(trained) == len([n for n in data if n.startswith("grad.")])
    r = routing_report(model, tokens)
    assert min(r["group_margin"], r["expert_margin"]) >= MIN_ROUTER_MARGIN, r
    assert r["bias_matters"] and r["groups_matter"], r

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
        h, worst, worst_rel, checked = 1e-5, 0.0, 0.0, 0
        for name in trained:
            view, grad = in_memory_view(model, name), data["grad." + name]
            for i in torch.randint(0, grad.numel(), (elements_per_param,), generator=gen):
                idx = tuple(int(j) for j in torch.unravel_index(i, grad.shape))
                orig = view[idx].item()
                f = {}
                for step in (-2, -1, 1, 2):
                    view[idx] = orig + step * h
                    f[step] = loss_fn()[1].item()
                view[idx] = orig
                fd = (f[-2] - 8 * f[-1] + 8 * f[1] - f[2]) / (12 * h)
                g = grad[idx].item()
                err = abs(fd - g)
                assert err <= 1e-9 + 1e-6 * abs(g), f"{name}{list(idx)}: fd {fd} vs {g}"
                worst = max(worst, err)
                if abs(g) > 1e-6:
                    worst_rel = max(worst_rel, err / abs(g))
                checked += 1
    print(f"{path}: reloaded with from_pretrained; stock logits agree to {stock_err:.1e} "
          f"(relative); logits, loss, routing margins (group {r['group_margin']:.3g}, expert "
          f"{r['expert_margin']:.3g}) and {checked} finite-difference gradient elements "
          f"({elements_per_param} per parameter, {len(trained)} parameters) agree (worst "
          f"|fd - grad| {worst:.1e}, worst relative {worst_rel:.1e} where |grad| > 1e-6)")


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(root, "tests", "golden", FILE))
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--check-only", action="store_true",
                    help="only re-check the existing file against transformers")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    if not args.check_only:
        make(deepseek_v3_config(), args.seed, args.out)
    check(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
