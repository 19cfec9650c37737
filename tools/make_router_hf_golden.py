#!/usr/bin/env python3
"""Golden data for Megaton's MoE router against Hugging Face transformers' own routers.

Writes tests/golden/router_hf_golden.safetensors (read by tests/golden/test_router_hf.cpp)
with two cases, each the router module of a tiny transformers model run on random
hidden states:

- deepseek_v3: the gate of DeepseekV3MoE (DeepseekV3TopkRouter): sigmoid scores,
  e_score_correction_bias for the choice only, n_group / topk_group group-limited
  routing, norm_topk_prob and routed_scaling_factor;
- qwen3_moe: the gate of Qwen3MoeSparseMoeBlock (Qwen3MoeTopKRouter): softmax over all
  experts, top-k, renormalised (norm_topk_prob).

For each case the file holds the router weight [E, H], the bias [E] (DeepSeek-V3), the
hidden states [T, H], an upstream gradient [T, E], the chosen experts [T, k] (I32) and
their weights [T, k], and the gradients of sum_t sum_j weights[t, j] *
upstream[t, indices[t, j]] with respect to the hidden states and the router weight
(torch autograd in float32, the router's own dtype). Run

    /work/venv-golden/bin/python tools/make_router_hf_golden.py

Seeds seed, seed + 1, ... are tried until every choice (groups and experts) is decided
by a margin of at least MIN_MARGIN, so that an fp32 implementation summing in another
order picks the same experts, and until the expert bias and the group limit each change
at least one token's choice (so the test notices if either is ignored).
"""

import argparse
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

TOKENS = 24
HIDDEN = 16
SEED = 1234
MIN_MARGIN = 1e-4
MAX_SEED_TRIES = 200


def deepseek_config():
    # topk / topk_group = 4 / 2 = 2: transformers scores a group by the sum of its top 2
    # selection scores whatever the top-k, Megatron by the sum of its top k / group_topk,
    # so the two agree only when that quotient is 2.
    return DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=16, n_group=4, topk_group=2,
                            num_experts_per_tok=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                            moe_intermediate_size=8, n_shared_experts=1, intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=2, vocab_size=32)


def qwen_config():
    return Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=2,
                          norm_topk_prob=True, moe_intermediate_size=8, intermediate_size=32,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          vocab_size=32)


def kth_gap(values, k):
    """Smallest gap between the k-th and (k+1)-th largest value of each row."""
    top = torch.topk(values, k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]).min().item()


def deepseek_case(seed):
    cfg = deepseek_config()
    gate = DeepseekV3MoE(cfg).gate
    gen = torch.Generator().manual_seed(seed)
    E, G, g, k = cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
    with torch.no_grad():
        gate.weight.copy_(torch.randn(E, HIDDEN, generator=gen) / HIDDEN**0.5)
        gate.e_score_correction_bias.copy_(0.2 * torch.randn(E, generator=gen))
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    upstream = torch.randn(TOKENS, E, generator=gen)
    # Margins, in float64 from the same values.
    scores = (x.double() @ gate.weight.detach().double().T).sigmoid()
    choice = scores + gate.e_score_correction_bias.double()
    group = choice.view(TOKENS, G, E // G).topk(2, dim=-1).values.sum(-1)
    mask = torch.zeros_like(group).scatter_(1, group.topk(g, dim=-1).indices, 1.0)
    masked = choice.masked_fill(mask.repeat_interleave(E // G, dim=1) == 0, float("-inf"))
    margin = min(kth_gap(group, g), kth_gap(masked, k))
    # Each feature must change at least one token's experts.
    chosen = set_rows(masked.topk(k, dim=-1).indices)
    bias_matters = chosen != set_rows(
        scores.masked_fill(mask.repeat_interleave(E // G, dim=1) == 0, float("-inf"))
        .topk(k, dim=-1).indices)
    groups_matter = chosen != set_rows(choice.topk(k, dim=-1).indices)
    ok = margin >= MIN_MARGIN and bias_matters and groups_matter
    return ok, margin, cfg, gate, x, upstream, {"e_score_correction_bias": gate.e_score_correction_bias}


def qwen_case(seed):
    cfg = qwen_config()
    gate = Qwen3MoeSparseMoeBlock(cfg).gate
    gen = torch.Generator().manual_seed(seed)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    with torch.no_grad():
        gate.weight.copy_(torch.randn(E, HIDDEN, generator=gen) / HIDDEN**0.5)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    upstream = torch.randn(TOKENS, E, generator=gen)
    margin = kth_gap((x.double() @ gate.weight.detach().double().T).softmax(-1), k)
    return margin >= MIN_MARGIN, margin, cfg, gate, x, upstream, {}


def set_rows(indices):
    return [frozenset(r) for r in indices.tolist()]


def record(name, make, seed0, out, meta):
    for seed in range(seed0, seed0 + MAX_SEED_TRIES):
        ok, margin, cfg, gate, x, upstream, extra = make(seed)
        if ok:
            break
    else:
        raise SystemExit(f"{name}: no seed in {MAX_SEED_TRIES} tries met the margin/coverage checks")
    x = x.clone().requires_grad_(True)
    gate.zero_grad(set_to_none=True)
    _, weights, indices = gate(x)
    assert weights.dtype == torch.float32 and weights.shape == indices.shape == (TOKENS, cfg.num_experts_per_tok)
    (weights * upstream.gather(1, indices)).sum().backward()
    out[f"{name}.router_weight"] = gate.weight.detach().clone()
    for key, value in extra.items():
        out[f"{name}.{key}"] = value.detach().clone().float()
    out[f"{name}.hidden_states"] = x.detach().clone()
    out[f"{name}.upstream"] = upstream
    out[f"{name}.topk_indices"] = indices.to(torch.int32)
    out[f"{name}.topk_weights"] = weights.detach().clone()
    out[f"{name}.grad_hidden_states"] = x.grad.detach().clone()
    out[f"{name}.grad_router_weight"] = gate.weight.grad.detach().clone()
    meta[name] = {"module": type(gate).__module__ + "." + type(gate).__qualname__,
                  "config": json.loads(cfg.to_json_string(use_diff=False)),
                  "seed": seed, "min_choice_margin": margin}
    print(f"{name}: seed {seed}, smallest choice margin {margin:.3g}")


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(root, "tests", "golden", "router_hf_golden.safetensors"))
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    out, meta = {}, {}
    record("deepseek_v3", deepseek_case, args.seed, out, meta)
    record("qwen3_moe", qwen_case, args.seed, out, meta)
    out = {k: v.contiguous() for k, v in out.items()}
    metadata = {"cases": json.dumps(meta), "torch_version": torch.__version__,
                "transformers_version": transformers.__version__, "compute_dtype": "float32",
                "loss": "sum over tokens t and slots j of topk_weights[t, j] * "
                        "upstream[t, topk_indices[t, j]]"}
    save_file(out, args.out, metadata=metadata)
    size = os.path.getsize(args.out)
    assert size < 200_000, size
    print(f"{args.out}: {len(out)} tensors, {size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
