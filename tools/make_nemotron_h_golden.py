#!/usr/bin/env python3
"""Golden reference data for Megaton's hybrid Mamba-2 parity test, from Hugging Face transformers.

Writes tests/golden/nemotron_h_tiny.safetensors: a tiny NemotronHForCausalLM with the layer
pattern "M*M-ME" (Mamba-2 mixer, attention without positional encoding, Mamba-2, squared-ReLU
MLP, Mamba-2, MoE with a sigmoid router, expert bias, squared-ReLU experts and a shared
expert) with seeded random weights, one batch of random tokens and labels, the logits, the
loss and the gradient of every parameter, in the layout of tools/make_golden.py's files
(docs/golden.md, section nemotron_h_tiny). Run

    pip install -r tools/requirements-golden.txt
    python tools/make_nemotron_h_golden.py              # writes, then checks
    python tools/make_nemotron_h_golden.py --check-only

Numerics as tools/make_golden.py: weights drawn in float32 and stored exactly; forward and
backward in float64 under Float64Everywhere (NemotronH casts to float32 in its RMSNorms, the
gated RMSNorm, the SSD scan, the attention softmax and the router; no RoPE to recompute);
check() reloads the file through from_pretrained, compares the stock (float32-island)
logits, and confirms the stored gradients against five-point differences of the float64
loss. The Mamba-2 mixers run transformers' torch path (mamba_ssm and causal_conv1d are not
installed: checked), in training mode, chunked SSD scan with chunk_size 8 over 20 tokens
(chunks of 8, 8 and 4: the inter-chunk state passing and the padded last chunk are used).

Choices that make the test catch something:
- mamba_num_heads x mamba_head_dim = 8 x 16 = 128 = 2 x hidden; n_groups 2 (heads 0-3 read
  B/C group 0, heads 4-7 group 1), so a wrong head-to-group map or an ungrouped gated norm
  shows;
- dt_bias, A_log, D, the conv weights and every norm weight random (not their init values),
  and the Mamba input projection and conv at scales where the scanned state, not only the
  D skip, carries the output (mamba_state_share in the metadata);
- dt = softplus(dt_raw + dt_bias) stays above time_step_min everywhere (by >= 2x; checked),
  so transformers' clamp of dt to [time_step_min, inf) is inactive: Megatron has no clamp;
- the MoE router's expert bias random and large enough that it changes some tokens'
  experts (checked); every top-2 choice decided by >= MIN_ROUTER_MARGIN.
check() also recomputes every Mamba-2 mixer's output with mamba2_reference, a sequential
(token by token) float64 recurrence written from the math in docs/golden.md, and asserts it
equals transformers' chunked output.
"""

import argparse
import importlib.util
import math
import os
import re
import sys
import tempfile

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import NemotronHConfig, NemotronHForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import (  # noqa: E402  (the shared methodology)
    BATCH,
    MAX_SEED_TRIES,
    MIN_ROUTER_MARGIN,
    SEED,
    Float64Everywhere,
    checkpoint_names,
)
from make_deepseek_v3_golden import kth_gap, row_sets  # noqa: E402

FILE = "nemotron_h_tiny.safetensors"
PATTERN = "M*M-ME"  # Megatron's --hybrid-layer-pattern; NemotronH's hybrid_override_pattern
# 20 tokens, chunk 8: not a multiple, so the SSD scan pads its last chunk and passes the state
# across two chunk boundaries.
SEQ = 20
CHUNK = 8
# The expert bias: N(0, BIAS_STD), about the spread of the sigmoid scores (as DeepSeek-V3's).
BIAS_STD = 0.03
# dt must stay this many times above time_step_min (transformers' lower clamp; Megatron has
# none), so the clamp never acts, not even under the finite-difference steps.
MIN_DT_FACTOR = 2.0


def nemotron_h_config():
    return NemotronHConfig(
        vocab_size=96,
        hidden_size=64,
        hybrid_override_pattern=PATTERN,  # stored as layers_block_type
        tie_word_embeddings=False,
        # attention ('*'): no RoPE in NemotronH
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        attention_bias=False,  # unused by NemotronHAttention (no bias either way)
        attention_dropout=0.0,
        sliding_window=None,
        # MLP ('-') and experts: up_proj, relu2, down_proj (no gate)
        intermediate_size=96,
        mlp_hidden_act="relu2",
        mlp_bias=False,
        # Mamba-2 ('M')
        ssm_state_size=16,
        mamba_num_heads=8,
        mamba_head_dim=16,
        mamba_hidden_act="silu",
        n_groups=2,
        conv_kernel=4,
        expand=2,  # unused by the model: d_inner = mamba_num_heads x mamba_head_dim = 128
        use_conv_bias=True,
        use_bias=False,
        chunk_size=CHUNK,
        time_step_min=0.001,  # the mixer clamps dt to [time_step_min, inf)
        time_step_max=0.1,  # init only
        time_step_floor=1e-4,  # init only
        # MoE ('E')
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        n_shared_experts=1,  # unused: NemotronHMoE always has one shared expert
        moe_latent_size=None,
        routed_scaling_factor=2.5,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
        layer_norm_epsilon=1e-5,  # block norms, final norm and the mixer's gated norm
        residual_in_fp32=False,  # unused by the model
        hidden_dropout=0.0,
        initializer_range=0.02,
        pad_token_id=None,  # a padding_idx would zero that embedding row's gradient
        bos_token_id=1,
        eos_token_id=2,
    )


def assert_torch_path():
    """transformers uses mamba_ssm's / causal_conv1d's kernels when importable; the reference
    is the torch path."""
    for package in ("mamba_ssm", "causal_conv1d", "kernels"):
        assert importlib.util.find_spec(package) is None, f"{package} is installed"


def mixers(model, kind):
    cls = {"M": "NemotronHMamba2Mixer", "E": "NemotronHMoE"}[kind]
    return [layer.mixer for layer in model.model.layers if type(layer.mixer).__name__ == cls]


def init_value(name, shape, gen):
    """The float32 value of parameter `name` (in-memory name) drawn from `gen`."""
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith(("norm.weight", "norm_f.weight")):
        return 1.0 + 0.1 * noise  # block norms, the gated norm, the final norm
    if name.endswith("mixer.D"):
        return 1.0 + 0.2 * noise  # init 1
    if name.endswith("mixer.dt_bias"):
        return -2.0 + 0.5 * noise  # softplus(-2) = 0.127; init gives dt in [1e-3, 0.1]
    if name.endswith("mixer.A_log"):
        return 0.5 + 0.5 * noise  # A = -exp(A_log) around -1.6; init log(1..heads)
    if name.endswith("mixer.in_proj.weight"):
        return 0.1 * noise  # z, x, B, C, dt_raw of std ~0.8 on a normalised input
    if name.endswith("mixer.conv1d.weight"):
        return 0.3 * noise
    if name.endswith("mixer.conv1d.bias"):
        return 0.1 * noise
    return 0.02 * noise


def build(config, seed):
    """The model in float64 with float32-representable weights and expert biases drawn from
    `seed`."""
    model = NemotronHForCausalLM._from_config(
        config, attn_implementation="eager", experts_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_value(name, p.shape, gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(BIAS_STD * torch.randn(b.shape, generator=gen, dtype=torch.float32))
    model = model.to(torch.float64)
    model.train()  # the Mamba mixers' training path (torch fallback); dropout is 0
    return model


def mamba2_reference(mixer, u):
    """Mamba-2 mixer output for input `u` [batch, seq, hidden], token by token in float64,
    from the math in docs/golden.md (not from transformers' code): in_proj -> [z | xBC | dt],
    causal depthwise conv with bias and SiLU on xBC -> [x | B | C], dt = max(softplus(dt_raw +
    dt_bias), time_step_min), A = -exp(A_log); per head h (group g = h // (heads / groups)):
    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t + D_h x_t; then
    RMSNorm over each group of d_inner / groups channels of y * silu(z), times the norm weight;
    out_proj."""
    cfg = mixer.config
    nh, hd, n, g, k = (mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups,
                       mixer.conv_kernel_size)
    d_inner = nh * hd
    b, length, _ = u.shape
    d = lambda t: t.detach().double()  # noqa: E731
    zxbcdt = u.double() @ d(mixer.in_proj.weight).T
    z, xbc, dt_raw = zxbcdt.split([d_inner, d_inner + 2 * g * n, nh], dim=-1)
    w = d(mixer.conv1d.weight)[:, 0, :]  # [conv_dim, K]; w[:, K-1] multiplies the current token
    padded = F.pad(xbc, (0, 0, k - 1, 0))
    conv = d(mixer.conv1d.bias) + sum(padded[:, j:j + length, :] * w[:, j] for j in range(k))
    xbc = F.silu(conv)
    x, bm, cm = xbc.split([d_inner, g * n, g * n], dim=-1)
    x = x.reshape(b, length, nh, hd)
    group_of_head = torch.arange(nh) // (nh // g)
    bm = bm.reshape(b, length, g, n)[:, :, group_of_head]  # [b, L, heads, N]
    cm = cm.reshape(b, length, g, n)[:, :, group_of_head]
    dt = F.softplus(dt_raw + d(mixer.dt_bias)).clamp(min=cfg.time_step_min)  # [b, L, heads]
    a = -torch.exp(d(mixer.A_log))
    state = torch.zeros(b, nh, hd, n, dtype=torch.float64)
    ys, state_part = [], []
    for t in range(length):
        decay = torch.exp(dt[:, t] * a)[:, :, None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * bm[:, t, :, None, :]
        from_state = (state * cm[:, t, :, None, :]).sum(-1)  # [b, heads, head_dim]
        ys.append(from_state + d(mixer.D)[:, None] * x[:, t])
        state_part.append(from_state)
    y = torch.stack(ys, dim=1).reshape(b, length, d_inner)
    gated = (y * F.silu(z)).reshape(b, length, g, d_inner // g)
    normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + cfg.layer_norm_epsilon)
    out = (normed.reshape(b, length, d_inner) * d(mixer.norm.weight)) @ d(mixer.out_proj.weight).T
    from_state = torch.stack(state_part, dim=1)
    share = (from_state.norm() / y.norm()).item()  # how much of y the scanned state carries
    return out, dt, share


def diagnostics(model, tokens):
    """One float64 forward with hooks: per Mamba mixer the reference recomputation's largest
    difference from transformers' output, the smallest dt and the state's share of y; per MoE
    layer the router margins (recomputed in float64 and asserted to be transformers'
    choice)."""
    cfg = model.config
    k = cfg.num_experts_per_tok
    assert cfg.n_group == 1 and cfg.topk_group == 1  # no group limit: top-k of all experts
    report = dict(ref_diff=0.0, ref_scale=0.0, min_dt=math.inf, state_share=math.inf,
                  expert_margin=math.inf, bias_matters=False)

    def mamba_hook(module, inputs, output):
        ref, dt, share = mamba2_reference(module, inputs[0].detach())
        report["ref_diff"] = max(report["ref_diff"], (ref - output.detach()).abs().max().item())
        report["ref_scale"] = max(report["ref_scale"], ref.abs().max().item())
        report["min_dt"] = min(report["min_dt"], dt.min().item())
        report["state_share"] = min(report["state_share"], share)

    def router_hook(module, inputs, output):
        logits, _, indices = output
        scores = logits.double().sigmoid()
        sel = scores + module.e_score_correction_bias.double()
        chosen = sel.topk(k, dim=-1).indices
        assert row_sets(chosen) == row_sets(indices), "recomputed routing differs from HF's"
        report["expert_margin"] = min(report["expert_margin"], kth_gap(sel, k).min().item())
        report["bias_matters"] |= row_sets(scores.topk(k, dim=-1).indices) != row_sets(chosen)

    handles = [m.register_forward_hook(mamba_hook) for m in mixers(model, "M")]
    handles += [m.gate.register_forward_hook(router_hook) for m in mixers(model, "E")]
    assert len(handles) == PATTERN.count("M") + PATTERN.count("E")
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


def checkpoint_bias_name(name):
    return "backbone." + name[len("model."):]


def acceptable(r, config):
    return (r["expert_margin"] >= MIN_ROUTER_MARGIN and r["bias_matters"]
            and r["min_dt"] >= MIN_DT_FACTOR * config.time_step_min)


def assert_reference(r):
    assert r["ref_diff"] <= 1e-12 * max(1.0, r["ref_scale"]), (
        f"sequential Mamba-2 reference differs from transformers by {r['ref_diff']}")


def make(config, seed, path):
    for seed in range(seed, seed + MAX_SEED_TRIES):
        model, tokens, labels = model_and_batch(config, seed)
        r = diagnostics(model, tokens)
        if acceptable(r, config):
            break
    else:
        raise SystemExit(f"{path}: no seed gave a router margin >= {MIN_ROUTER_MARGIN} with the "
                         f"expert bias changing a choice and dt >= {MIN_DT_FACTOR} x time_step_min")
    assert_reference(r)

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
    # The expert bias is a buffer (no gradient): stored under its checkpoint name.
    for name in bias_names(model):
        params[checkpoint_bias_name(name)] = model.get_buffer(name).detach()
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

    metadata = {
        "config": config.to_json_string(use_diff=False),
        "model_class": NemotronHForCausalLM.__name__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "seed": str(seed),
        "compute_dtype": "float64",
        "loss": "mean over all batch*seq positions of cross_entropy(logits[b,s], labels[b,s]), "
                "no shift",
        "loss_fp64": repr(loss.item()),
        "hybrid_layer_pattern": config.hybrid_override_pattern,
        "min_router_topk_margin": f"{r['expert_margin']:.6g}",
        "min_mamba_dt": f"{r['min_dt']:.6g}",
        "mamba_state_share": f"{r['state_share']:.6g}",
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_file(out, path, metadata=metadata)
    print(f"{path}: {len(out)} tensors, {os.path.getsize(path)} bytes, loss {loss.item():.10f}, "
          f"seed {seed}, router margin {r['expert_margin']:.3g}, min dt {r['min_dt']:.3g}, "
          f"state share of y >= {r['state_share']:.3g}")


def in_memory_view(model, name):
    """The model's tensor (or a view of it) holding checkpoint parameter `name`. Written by
    hand from the published NemotronH layout (backbone.* for the model, experts one by one):
    an independent check of the names revert_weight_conversion produced."""
    m = re.fullmatch(r"backbone\.(layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight",
                     name)
    if m:
        experts = model.model.get_submodule(m.group(1))
        return getattr(experts, m.group(3))[int(m.group(2))]
    if name.startswith("backbone."):
        return model.model.get_parameter(name[len("backbone."):])
    return model.get_parameter(name)


def check(path, elements_per_param=3):
    """Reloads `path` through from_pretrained in float64 and checks the stored logits, loss,
    routing margin, dt margin, the sequential Mamba-2 reference and, by finite differences,
    some elements of every stored gradient (five-point, step 1e-5, as
    tools/make_deepseek_v3_golden.py). A step of at most 2e-5 in one weight moves a selection
    score or a dt by far less than the margins, so no expert choice changes and the dt clamp
    stays inactive."""
    assert_torch_path()
    data = load_file(path)
    params = {k: v for k, v in data.items() if not k.startswith(("grad.", "input.", "output."))}
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(meta["config"])
        save_file(params, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        model = NemotronHForCausalLM.from_pretrained(
            tmp, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager")
    model.train()
    config = model.config
    assert config.hybrid_override_pattern == PATTERN == meta["hybrid_layer_pattern"]
    assert config.chunk_size == CHUNK and SEQ % CHUNK != 0
    tokens, labels = data["input.tokens"].long(), data["input.labels"].long()
    assert tokens.shape == (BATCH, SEQ)
    with torch.no_grad():  # stock transformers, float32 islands included
        stock = model(input_ids=tokens, use_cache=False).logits.float()
    stock_err = ((stock - data["output.logits"]).norm() / data["output.logits"].norm()).item()
    assert stock_err < 1e-5, f"stock transformers logits differ by {stock_err}"
    biases = {checkpoint_bias_name(n): n for n in bias_names(model)}
    for name, value in params.items():
        held = model.get_buffer(biases[name]) if name in biases else in_memory_view(model, name)
        assert torch.equal(held.to(torch.float32), value), name
    assert set(biases) <= set(params)
    assert not any(("grad." + b) in data for b in biases)
    trained = [n for n in params if n not in biases]
    assert len(trained) == len([n for n in data if n.startswith("grad.")])
    assert sum(params[n].numel() for n in trained) == sum(p.numel() for p in model.parameters())
    r = diagnostics(model, tokens)
    assert acceptable(r, config), r
    assert_reference(r)

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
          f"(relative); logits, loss, router margin {r['expert_margin']:.3g}, min dt "
          f"{r['min_dt']:.3g} (time_step_min {config.time_step_min}), sequential Mamba-2 "
          f"reference to {r['ref_diff']:.1e}, and {checked} finite-difference gradient elements "
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
    assert_torch_path()
    if not args.check_only:
        make(nemotron_h_config(), args.seed, args.out)
    check(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
