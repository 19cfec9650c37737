#!/usr/bin/env python3
"""Golden data for Megaton's MoE router tests, produced by Megatron-LM's own functions.

Runs Megatron-LM's router (megatron/core/transformer/moe/router.py, TopKRouter.routing)
and its helpers (moe_utils.py: topk_routing_with_score_function, group_limited_topk,
compute_routing_scores_for_aux_loss, switch_load_balancing_loss_func, z_loss_func,
sinkhorn, get_capacity, apply_router_token_dropping, get_updated_expert_bias,
apply_random_logits / RandomSTE, router_gating_linear, MoEAuxLossAutoScaler) and its
metrics tracker (moe_logging.py) on the CPU, on seeded random logits, and writes what they
return. This script calls Megatron-LM; it contains none of its code. Run

    python tools/make_router_golden.py --megatron /path/to/Megatron-LM \\
        [--megatron-commit SHA] [--out tests/golden/router_golden.safetensors]

with torch 2.15 and safetensors (tools/requirements-golden.txt). The tests do not need it.

Output: one safetensors file plus a JSON sidecar (same stem, .json) holding the same
metadata as the file's "__metadata__" (key "golden", a JSON string):
  {"format": ..., "megatron": {...}, "cases": {case: {options, tensors, checks}},
   "f64_tensors": [...], "moe_layer_freq": [...], "capacity": [...]}
Tensor names are "<case>.<field>" ("<case>.mb<m>.<field>" for cases of several
micro-batches, "<case>.rank<r>.mb<m>.<field>" for the two-rank cases). Megaton's
safetensors reader holds neither F64 nor BOOL, so:
  - float64 tensors are stored as I64 holding the IEEE-754 bit pattern (bit_cast to
    double); every such name is listed in "f64_tensors";
  - boolean tensors (routing maps, padding masks) are stored as I32 0/1;
  - scalars are stored with shape [1].

Router cases (TopKRouter.routing(logits [S, B, E], padding_mask) on a router built from a
TransformerConfig, in training mode unless "training": false):
  logits [S, B, E]      the input (router dtype: F32, F64-as-I64, or BF16)
  upstream [S*B, E]     random gradient of the probs; the backward is of
                        sum(probs * upstream), with each aux/z loss injected by
                        MoEAuxLossAutoScaler at "aux_loss_backward_scale"
  probs [S*B, E], routing_map [S*B, E]
  dlogits [S, B, E]     d/dlogits of the above; dlogits_aux: the same with upstream = 0
                        (only the injected aux and z losses)
  loss.<type>           the scalar each of z_loss / aux_loss / seq_aux_loss /
                        global_aux_loss injected (coefficient included; times the local
                        token count when calculate_per_token_loss)
  logged.<name>         what MoEMetricsTracker.report puts in the log for this one-layer
                        model (loss / coeff, summed over micro-batches, times 1/M)
  and, when the case has them: pre_drop_probs / pre_drop_routing_map (capacity cases),
  expert_bias, local_tokens_per_expert, updated_expert_bias (expert bias),
  global_tokens_per_expert (running sum after each micro-batch), random_logits (forced
  balancing: the normal draw the router routed on), sinkhorn_out, padding_mask.

Numerics: each case draws its logits from its own seed and is kept only if its routing
is stable: the routing maps are unchanged when the logits move by 1e-4 (several random
perturbations), so an implementation that differs by rounding selects the same experts.
Where Megatron's result depends on torch.topk's order among equal values (token dropping
with the "position" policy, and the zero-probability slots that
--moe-pad-expert-input-to-capacity fills), "checks" says which parts are exact.

Function cases ("fn.*") call one moe_utils function directly; "dist.*" cases run two
gloo ranks (global_aux_loss and the expert bias over DP2, seq_aux_loss over TP2) and the
same data on one rank; each case's "relation" says what was asserted between them.

To run Megatron on the CPU the script patches, in this process only:
torch.cuda.current_device (TopKRouter puts its buffers there) returns "cpu";
moe_utils.get_cuda_rng_tracker (RandomSTE forks the CUDA RNG) is a CPU RNG fork; and
router.MoEAuxLossAutoScaler is a wrapper that records each injected loss and calls the real
one. Process groups are real: torch.distributed with gloo and Megatron's
parallel_state.initialize_model_parallel, world size 1 (and 2 for the "dist." cases,
spawned on the CPU).
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import typing
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

BASE_SEED = 20260822
PERTURB_EPS = 1e-4
PERTURB_TRIES = 4
MAX_SEED_TRIES = 200

ROUTER_PY = "megatron/core/transformer/moe/router.py"
M = None  # namespace of Megatron modules, filled by import_megatron()


# ----------------------------------------------------------------------------------------
# Megatron import and the CPU patches
# ----------------------------------------------------------------------------------------


class _Namespace:
    pass


class _CpuRngTracker:
    """Stands in for Megatron's CUDA RNG tracker: fork() runs the body under a CPU RNG
    seeded with `seed`, leaving the global RNG as it was."""

    def __init__(self):
        self.seed = 0

    @contextlib.contextmanager
    def fork(self, name=None):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            yield


class _InjectedLossRecorder:
    """Replaces router.MoEAuxLossAutoScaler: records each loss the router injects, in
    order, and forwards to the real autograd function."""

    real = None
    log = []

    @staticmethod
    def apply(activation, loss):
        _InjectedLossRecorder.log.append(loss.detach().clone())
        return _InjectedLossRecorder.real.apply(activation, loss)

    @staticmethod
    def set_loss_scale(scale):
        _InjectedLossRecorder.real.set_loss_scale(scale)


def import_megatron(path):
    global M
    path = os.path.abspath(path)
    if not os.path.isfile(os.path.join(path, ROUTER_PY)):
        sys.exit(f"error: {path} is not a Megatron-LM checkout (no {ROUTER_PY})")
    sys.path.insert(0, path)
    warnings.filterwarnings("ignore")
    if not hasattr(typing, "override"):  # megatron.training uses typing.override (3.12)
        typing.override = lambda f: f
    torch.cuda.current_device = lambda: "cpu"

    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_logging, moe_utils, router
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not os.path.abspath(megatron.core.__file__).startswith(path + os.sep):
        sys.exit(f"error: imported megatron.core from {megatron.core.__file__}, not from {path}")

    ns = _Namespace()
    ns.path = path
    ns.parallel_state = parallel_state
    ns.moe_utils = moe_utils
    ns.router = router
    ns.moe_logging = moe_logging
    ns.TransformerConfig = TransformerConfig
    ns.rng_tracker = _CpuRngTracker()
    moe_utils.get_cuda_rng_tracker = lambda: ns.rng_tracker
    _InjectedLossRecorder.real = moe_utils.MoEAuxLossAutoScaler
    router.MoEAuxLossAutoScaler = _InjectedLossRecorder
    try:
        from megatron.training.arguments import moe_freq_type

        ns.moe_freq_type = moe_freq_type
    except Exception as e:  # the pattern table is optional
        print(f"warning: megatron.training.arguments not importable ({e}); no moe_layer_freq table")
        ns.moe_freq_type = None
    M = ns


def init_distributed(init_file, rank, world_size, tp):
    dist.init_process_group(
        "gloo", init_method="file://" + init_file, rank=rank, world_size=world_size
    )
    M.parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def reinit_model_parallel(tp):
    M.parallel_state.destroy_model_parallel()
    M.parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


# ----------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------


class Golden:
    def __init__(self):
        self.tensors = {}
        self.f64 = []
        self.cases = {}

    def add(self, name, t):
        assert name not in self.tensors, name
        t = torch.as_tensor(t).detach().cpu().contiguous()
        if t.dim() == 0:
            t = t.reshape(1)
        if t.dtype == torch.float64:
            t = t.view(torch.int64)
            self.f64.append(name)
        elif t.dtype == torch.bool:
            t = t.to(torch.int32)
        elif t.dtype in (torch.int32, torch.int64, torch.float32, torch.bfloat16):
            pass
        else:
            raise TypeError(f"{name}: unexpected dtype {t.dtype}")
        self.tensors[name] = t.clone()


# ----------------------------------------------------------------------------------------
# Router cases
# ----------------------------------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}
AUX_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def case(name, **kw):
    spec = dict(
        name=name,
        score_function="softmax",
        topk=2,
        num_experts=8,
        seq_length=8,
        micro_batch_size=4,
        dtype="fp32",
        pre_softmax=False,
        topk_scaling_factor=None,
        num_groups=None,
        group_topk=None,
        load_balancing_type="none",
        aux_loss_coeff=0.0,
        z_loss_coeff=None,
        capacity_factor=None,
        drop_policy="probs",
        pad_to_capacity=False,
        expert_bias=False,
        bias_update_rate=1e-3,
        calculate_per_token_loss=False,
        training=True,
        micro_batches=1,
        force_load_balancing=False,
        padding=False,
        logit_scale=2.0,
    )
    for k in kw:
        assert k in spec, k
    spec.update(kw)
    return spec


def aux_coeff(spec, aux_type):
    lb, c = spec["load_balancing_type"], spec["aux_loss_coeff"]
    if isinstance(lb, list):
        return c[lb.index(aux_type)] if aux_type in lb else 0.0
    return c if lb == aux_type else 0.0


def enabled_losses(spec):
    """Injection order inside TopKRouter.routing: z-loss (apply_z_loss), then
    _apply_aux_loss, _apply_seq_aux_loss, _apply_global_aux_loss."""
    if not spec["training"]:
        return []
    out = ["z_loss"] if spec["z_loss_coeff"] is not None else []
    return out + [t for t in AUX_TYPES if aux_coeff(spec, t) > 0]


def backward_scale(spec):
    # What megatron/core/pipeline_parallel/schedules.py sets (CP size 1, grad scaler 1):
    # 1 / num_microbatches, or 1 with calculate_per_token_loss.
    return 1.0 if spec["calculate_per_token_loss"] else 1.0 / spec["micro_batches"]


def router_dtype_option(spec):
    return {"fp32": "fp32", "fp64": "fp64", "bf16": None}[spec["dtype"]]


def build_router(spec, expert_bias):
    cfg = M.TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        add_bias_linear=False,
        num_moe_experts=spec["num_experts"],
        moe_router_topk=spec["topk"],
        moe_router_score_function=spec["score_function"],
        moe_router_pre_softmax=spec["pre_softmax"],
        moe_router_topk_scaling_factor=spec["topk_scaling_factor"],
        moe_router_num_groups=spec["num_groups"],
        moe_router_group_topk=spec["group_topk"],
        moe_router_load_balancing_type=spec["load_balancing_type"],
        moe_aux_loss_coeff=spec["aux_loss_coeff"],
        moe_z_loss_coeff=spec["z_loss_coeff"],
        moe_expert_capacity_factor=spec["capacity_factor"],
        moe_token_drop_policy=spec["drop_policy"],
        moe_pad_expert_input_to_capacity=spec["pad_to_capacity"],
        moe_router_enable_expert_bias=spec["expert_bias"],
        moe_router_bias_update_rate=spec["bias_update_rate"],
        moe_router_force_load_balancing=spec["force_load_balancing"],
        calculate_per_token_loss=spec["calculate_per_token_loss"],
        moe_router_dtype=router_dtype_option(spec),
    )
    r = M.router.TopKRouter(cfg, pg_collection=M.moe_utils.get_default_pg_collection())
    r.set_layer_number(1)
    if spec["expert_bias"]:
        r.expert_bias.copy_(expert_bias)
    if not spec["training"]:
        r.eval()
    return r


def pre_drop_routing(spec, logits_2d, expert_bias):
    """The router's own topk_routing_with_score_function call, before token dropping."""
    return M.moe_utils.topk_routing_with_score_function(
        logits_2d,
        spec["topk"],
        use_pre_softmax=spec["pre_softmax"],
        num_groups=spec["num_groups"],
        group_topk=spec["group_topk"],
        scaling_factor=spec["topk_scaling_factor"],
        score_function=spec["score_function"],
        expert_bias=expert_bias if spec["expert_bias"] else None,
        fused=False,
    )


def run_router(spec, data, perturb=None):
    """Runs one case through TopKRouter.routing over its micro-batches. `data` holds
    per-micro-batch logits / upstream / (padding mask, random seed) and the expert bias.
    With `perturb` (a list of noise tensors), adds perturb[m] * PERTURB_EPS to what the
    router routes on and returns only the routing maps."""
    M.moe_logging.destroy_moe_metrics_tracker()
    E = spec["num_experts"]
    router = build_router(spec, data.get("expert_bias"))
    _InjectedLossRecorder.set_loss_scale(torch.tensor(backward_scale(spec), dtype=torch.float32))
    losses = enabled_losses(spec)
    out = {"mb": []}
    for m in range(spec["micro_batches"]):
        mb = data["mb"][m]
        leaf = mb["logits"].clone().requires_grad_(True)
        x = leaf
        if spec["force_load_balancing"]:
            M.rng_tracker.seed = mb["rng_seed"]
            x = M.moe_utils.apply_random_logits(leaf)
        if perturb is not None:
            x = x + (perturb[m] * PERTURB_EPS).to(x.dtype)
        _InjectedLossRecorder.log.clear()
        pad = mb.get("padding_mask")
        probs, routing_map = router.routing(x, padding_mask=pad)
        injected = list(_InjectedLossRecorder.log)
        assert perturb is not None or len(injected) == len(losses), (
            spec["name"],
            len(injected),
            losses,
        )
        res = {"routing_map": routing_map.detach().clone()}
        if spec["capacity_factor"] is not None:
            pp, pm = pre_drop_routing(spec, x.detach().reshape(-1, E), data.get("expert_bias"))
            res["pre_drop_probs"], res["pre_drop_routing_map"] = pp, pm
        if perturb is None:
            res["probs"] = probs.detach().clone()
            if spec["force_load_balancing"]:
                res["random_logits"] = x.detach().clone()
            (probs * mb["upstream"]).sum().backward(retain_graph=True)
            res["dlogits"] = leaf.grad.detach().clone()
            if losses:
                leaf.grad = None
                (probs * 0).sum().backward()
                res["dlogits_aux"] = leaf.grad.detach().clone()
            for name, val in zip(losses, injected):
                res["loss." + name] = val
            if router.global_tokens_per_expert is not None:
                res["global_tokens_per_expert"] = router.global_tokens_per_expert.clone()
        out["mb"].append(res)
    if perturb is None and spec["expert_bias"]:
        out["local_tokens_per_expert"] = router.local_tokens_per_expert.clone()
        out["updated_expert_bias"] = M.moe_utils.get_updated_expert_bias(
            router.local_tokens_per_expert.clone().unsqueeze(0),
            router.expert_bias.clone().unsqueeze(0),
            spec["bias_update_rate"],
            tp_dp_cp_group=M.moe_utils.get_default_pg_collection().tp_dp_cp,
        )[0]
    if perturb is None:
        out["logged"] = report_metrics(spec)
    return out


def report_metrics(spec):
    """MoEMetricsTracker.report as megatron/training/training.py calls it (loss_scale =
    1 / num_microbatches), for a model of one MoE layer; returns the loss scalars it puts
    in total_loss_dict."""
    tracker = M.moe_logging.get_moe_metrics_tracker()
    if not tracker.metrics:
        return {}
    total = {}
    tracker.report(
        loss_scale=1.0 / spec["micro_batches"],
        iteration=1,
        num_layers=1,
        num_moe_layers=1,
        total_loss_dict=total,
    )
    return {k: float(v) for k, v in total.items()}


def stable_maps(spec, res):
    """The parts of the routing that must not move under a 1e-4 perturbation."""
    maps = []
    for r in res["mb"]:
        if spec["capacity_factor"] is not None and (
            spec["drop_policy"] == "position" or spec["pad_to_capacity"]
        ):
            maps.append(r["pre_drop_routing_map"])
        else:
            maps.append(r["routing_map"])
    return maps


def checks_for(spec):
    if spec["capacity_factor"] is None:
        return {"routing_map": "exact", "probs": "exact"}
    if spec["drop_policy"] == "position":
        return {
            "routing_map": "invariants",
            "probs": "invariants",
            "note": "Megatron keeps, per expert, the `expert_capacity` routed tokens that "
            "torch.topk(routing_map.int(), k=capacity, dim=0, sorted=False) returns among "
            "equal values: on the CPU not the first ones in token order. Exact: "
            "pre_drop_*; for the result check that routing_map is within pre_drop_routing_map "
            "(or, with pad_to_capacity, has exactly expert_capacity entries per expert), that "
            "each expert keeps min(count, capacity) routed tokens, and probs = pre_drop_probs "
            "on the kept entries, 0 elsewhere. dlogits depend on which tokens were kept.",
        }
    if spec["pad_to_capacity"]:
        return {
            "routing_map": "exact where probs != 0",
            "probs": "exact",
            "note": "With pad_to_capacity every expert has exactly expert_capacity entries; "
            "when it has fewer routed tokens than that, torch.topk picks the padding slots "
            "among tokens of probability 0 (an order among equal values).",
        }
    return {"routing_map": "exact", "probs": "exact"}


def make_data(spec, seed):
    g = torch.Generator().manual_seed(seed)
    S, B, E = spec["seq_length"], spec["micro_batch_size"], spec["num_experts"]
    dt = DTYPES[spec["dtype"]]
    data = {"mb": []}
    if spec["expert_bias"]:
        data["expert_bias"] = (torch.rand(E, generator=g, dtype=torch.float64) * 0.2 - 0.1).float()
    for m in range(spec["micro_batches"]):
        gen_dt = torch.float64 if dt == torch.float64 else torch.float32
        logits = (torch.randn(S, B, E, generator=g, dtype=gen_dt) * spec["logit_scale"]).to(dt)
        upstream = torch.randn(S * B, E, generator=g, dtype=gen_dt).to(dt)
        mb = {"logits": logits, "upstream": upstream}
        if spec["padding"]:
            # Megatron's masks inside the router are True = padding (excluded).
            mb["padding_mask"] = torch.rand(S, B, generator=g) < 0.25
        if spec["force_load_balancing"]:
            mb["rng_seed"] = seed * 10 + m
        data["mb"].append(mb)
    return data


def no_exact_ties(spec, data):
    """bf16 logits: the k-th and (k+1)-th logits of a token must differ."""
    if spec["dtype"] != "bf16":
        return True
    for mb in data["mb"]:
        v = (
            mb["logits"]
            .float()
            .reshape(-1, spec["num_experts"])
            .sort(dim=-1, descending=True)
            .values
        )
        k = spec["topk"]
        if (v[:, k - 1] == v[:, k]).any():
            return False
    return True


def is_stable(spec, data, seed):
    """True when no perturbation of the logits by PERTURB_EPS moves the routing."""
    with torch.no_grad():
        zero = [torch.zeros(1)] * spec["micro_batches"]
        base = stable_maps(spec, run_router(spec, data, perturb=zero))
        pg = torch.Generator().manual_seed(seed + 1)
        for _ in range(PERTURB_TRIES):
            noise = [
                torch.randn(mb["logits"].shape, generator=pg, dtype=torch.float64)
                for mb in data["mb"]
            ]
            maps = stable_maps(spec, run_router(spec, data, perturb=noise))
            if any(not torch.equal(a, b) for a, b in zip(base, maps)):
                return False
    return True


def find_stable_data(spec, seed0):
    for attempt in range(MAX_SEED_TRIES):
        seed = seed0 + attempt * 7919
        data = make_data(spec, seed)
        if not no_exact_ties(spec, data) or not is_stable(spec, data, seed):
            continue
        if spec["expert_bias"] and not bias_changes_selection(spec, data):
            continue
        return seed, data
    raise RuntimeError(f"{spec['name']}: no stable seed in {MAX_SEED_TRIES} tries")


def bias_changes_selection(spec, data):
    """The expert bias must change at least one token's experts, or the case tests nothing."""
    E = spec["num_experts"]
    with torch.no_grad():
        x = data["mb"][0]["logits"].reshape(-1, E)
        _, with_bias = pre_drop_routing(spec, x, data["expert_bias"])
        _, without = pre_drop_routing(spec, x, torch.zeros(E))
    return not torch.equal(with_bias, without)


def emit_router_case(golden, spec, index):
    seed, data = find_stable_data(spec, BASE_SEED + 1000 * index)
    torch.manual_seed(seed)  # TopKRouter's weight init draws from the global RNG
    res = run_router(spec, data)
    name = spec["name"]
    Mb = spec["micro_batches"]
    tensors = []

    def add(field, t, m=None):
        full = f"{name}.{field}" if m is None or Mb == 1 else f"{name}.mb{m}.{field}"
        golden.add(full, t)
        tensors.append(full)

    if spec["expert_bias"]:
        add("expert_bias", data["expert_bias"])
    for m, (mb, r) in enumerate(zip(data["mb"], res["mb"])):
        add("logits", mb["logits"], m)
        add("upstream", mb["upstream"], m)
        if "padding_mask" in mb:
            add("padding_mask", mb["padding_mask"], m)
        for field in (
            "random_logits",
            "probs",
            "routing_map",
            "pre_drop_probs",
            "pre_drop_routing_map",
            "dlogits",
            "dlogits_aux",
            "global_tokens_per_expert",
        ):
            if field in r:
                add(field, r[field], m)
        for k, v in r.items():
            if k.startswith("loss."):
                add(k, v, m)
    for field in ("local_tokens_per_expert", "updated_expert_bias"):
        if field in res:
            add(field, res[field])
    for k, v in res["logged"].items():
        add("logged." + k, torch.tensor(v, dtype=torch.float64))

    meta = {k: v for k, v in spec.items() if k not in ("name", "logit_scale")}
    meta.update(
        seed=seed,
        num_tokens=spec["seq_length"] * spec["micro_batch_size"],
        moe_router_dtype=router_dtype_option(spec),
        aux_loss_backward_scale=backward_scale(spec),
        injected_losses=enabled_losses(spec),
        logged_names=sorted(res["logged"].keys()),
        checks=checks_for(spec),
        tensors=tensors,
    )
    if spec["capacity_factor"] is not None:
        meta["expert_capacity"] = M.moe_utils.get_capacity(
            num_tokens=meta["num_tokens"] * spec["topk"],
            num_experts=spec["num_experts"],
            capacity_factor=spec["capacity_factor"],
        )
    if spec["load_balancing_type"] == "sinkhorn" and spec["training"]:
        out = M.moe_utils.sinkhorn(data["mb"][0]["logits"].reshape(-1, spec["num_experts"]).float())
        golden.add(f"{name}.sinkhorn_out", out)
        tensors.append(f"{name}.sinkhorn_out")
    golden.cases[name] = meta


def router_cases():
    # Options: sf score function, k topk, e experts, b micro-batch size (sequences), and
    # case()'s keywords. S = 8 positions unless given.
    SM, SG, SP = "softmax", "sigmoid", "sqrtsoftplus"
    AUX = dict(load_balancing_type="aux_loss", aux_loss_coeff=0.1)
    SEQ = dict(load_balancing_type="seq_aux_loss", aux_loss_coeff=0.1)
    V3 = dict(num_groups=8, group_topk=4, expert_bias=True, topk_scaling_factor=2.5)

    def c(name, sf=SM, k=2, e=8, b=4, **kw):
        return case(name, score_function=sf, topk=k, num_experts=e, micro_batch_size=b, **kw)

    # fmt: off
    return [
        # Scores and selection.
        c("softmax_k2_e8"),
        c("softmax_k4_e16", k=4, e=16, b=3),
        c("softmax_pre_k1_e8", k=1, pre_softmax=True),
        c("softmax_pre_k2_e16", e=16, b=3, pre_softmax=True),
        c("softmax_k2_e8_scaled", topk_scaling_factor=2.5),
        c("softmax_pre_k4_e16_scaled", k=4, e=16, b=3, pre_softmax=True, topk_scaling_factor=1.5),
        c("softmax_k2_e8_fp64", b=3, dtype="fp64"),
        c("softmax_pre_k4_e16_fp64", k=4, e=16, b=3, pre_softmax=True, dtype="fp64"),
        c("softmax_k2_e8_bf16", b=3, dtype="bf16"),
        c("sigmoid_k1_e8", SG, k=1),
        c("sigmoid_k2_e8", SG),
        c("sigmoid_k4_e16_scaled", SG, k=4, e=16, b=3, topk_scaling_factor=2.5),
        c("sigmoid_k2_e8_fp64", SG, b=3, dtype="fp64"),
        c("sigmoid_pre_k2_e8", SG, b=3, pre_softmax=True),  # pre_softmax: no effect
        c("sigmoid_k4_e16_bias", SG, k=4, e=16, b=3, expert_bias=True),
        c("sqrtsoftplus_k1_e8", SP, k=1),
        c("sqrtsoftplus_k2_e8", SP),
        c("sqrtsoftplus_k4_e16_bias_scaled", SP, k=4, e=16, b=3, expert_bias=True,
          topk_scaling_factor=2.5),
        c("sqrtsoftplus_k4_e16_fp64", SP, k=4, e=16, b=3, dtype="fp64"),
        # Group-limited routing.
        c("group_softmax_k4_e16_g4_t2", k=4, e=16, b=3, num_groups=4, group_topk=2),
        c("group_softmax_pre_k4_e16_g4_t2", k=4, e=16, b=3, num_groups=4, group_topk=2,
          pre_softmax=True),
        c("group_sigmoid_bias_k4_e16_g8_t4_scaled", SG, k=4, e=16, b=3, **V3),
        c("group_sigmoid_k4_e16_g4_t3", SG, k=4, e=16, b=3, num_groups=4, group_topk=3),
        c("group_sqrtsoftplus_k2_e16_g4_t1", SP, e=16, b=3, num_groups=4, group_topk=1),
        c("group_softmax_k2_e8_g2_t1_fp64", b=3, num_groups=2, group_topk=1, dtype="fp64"),
        # Token dropping.
        c("cap_probs_k2_e8_cf1", capacity_factor=1.0),
        c("cap_probs_k2_e8_cf1_pad", capacity_factor=1.0, pad_to_capacity=True),
        c("cap_position_k2_e8_cf1", capacity_factor=1.0, drop_policy="position"),
        c("cap_position_k2_e8_cf1p25_pad", capacity_factor=1.25, drop_policy="position",
          pad_to_capacity=True),
        c("cap_probs_pre_k1_e8_cf0p5", k=1, pre_softmax=True, capacity_factor=0.5),
        c("cap_probs_k2_e8_cf1p1", capacity_factor=1.1),  # ceil(8 * 1.1) = 9
        c("cap_probs_k2_e8_cf5_nodrop", capacity_factor=5.0),
        c("cap_probs_sigmoid_k4_e16_cf1_aux", SG, k=4, e=16, b=3, capacity_factor=1.0, **AUX),
        # Load-balancing losses and z-loss.
        c("aux_softmax_k2_e8", **AUX),
        c("aux_sigmoid_k2_e8", SG, **AUX),
        c("aux_sqrtsoftplus_k4_e16", SP, k=4, e=16, b=3, **AUX),
        c("aux_softmax_pre_k1_e8", k=1, pre_softmax=True, **AUX),
        c("aux_softmax_k2_e8_fp64", b=3, dtype="fp64", **AUX),
        c("seqaux_softmax_k2_e8", **SEQ),
        c("seqaux_sigmoid_bias_group_k4_e16_g8_t4_scaled", SG, k=4, e=16, b=3, **V3, **SEQ),
        c("globalaux_softmax_k2_e8_mb3", b=2, micro_batches=3,
          load_balancing_type="global_aux_loss", aux_loss_coeff=0.1),
        c("combined_aux_seq_global_z_k2_e8_mb2", b=2, micro_batches=2, z_loss_coeff=0.01,
          load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
          aux_loss_coeff=[0.1, 0.05, 0.2]),
        c("zloss_softmax_k2_e8", z_loss_coeff=0.01),
        c("zloss_aux_sigmoid_k2_e8_fp64", SG, b=3, dtype="fp64", z_loss_coeff=0.01, **AUX),
        c("aux_z_per_token_k2_e8", z_loss_coeff=0.01, calculate_per_token_loss=True, **AUX),
        c("aux_seq_z_padding_k2_e8", z_loss_coeff=0.01, padding=True,
          load_balancing_type=["aux_loss", "seq_aux_loss"], aux_loss_coeff=[0.1, 0.1]),
        c("aux_z_eval_k2_e8", z_loss_coeff=0.01, training=False, **AUX),
        # Sinkhorn.
        c("sinkhorn_k1_e8_train", k=1, load_balancing_type="sinkhorn"),
        c("sinkhorn_k2_e8_train", load_balancing_type="sinkhorn"),
        c("sinkhorn_k2_e8_eval", load_balancing_type="sinkhorn", training=False),
        # Forced balancing (RandomSTE).
        c("force_softmax_k2_e8", force_load_balancing=True),
        c("force_group_sigmoid_k4_e16_g4_t2", SG, k=4, e=16, b=3, num_groups=4, group_topk=2,
          force_load_balancing=True),
    ]
    # fmt: on


# ----------------------------------------------------------------------------------------
# Direct calls of the moe_utils functions
# ----------------------------------------------------------------------------------------


def emit_function_cases(golden):
    mu = M.moe_utils
    g = torch.Generator().manual_seed(BASE_SEED + 99)

    def meta(name, **kw):
        kw["tensors"] = sorted(n for n in golden.tensors if n.startswith(name + "."))
        golden.cases[name] = kw

    # switch_load_balancing_loss_func(probs, tokens_per_expert, total_num_tokens, topk,
    # num_experts, moe_aux_loss_coeff); loss and d loss / d probs.
    for dt, suffix in ((torch.float32, ""), (torch.float64, "_fp64")):
        name = "fn.switch_loss" + suffix
        T, E, k = 24, 8, 2
        probs = (
            torch.softmax(torch.randn(T, E, generator=g, dtype=torch.float64), -1)
            .to(dt)
            .requires_grad_(True)
        )
        tpe = torch.randint(0, 2 * T * k // E, (E,), generator=g).to(dt)
        total = 3 * T  # as for an aux loss over a group of 3 ranks
        loss = mu.switch_load_balancing_loss_func(probs, tpe, total, k, E, 0.01)
        loss.backward()
        golden.add(name + ".probs", probs.detach())
        golden.add(name + ".tokens_per_expert", tpe)
        golden.add(name + ".loss", loss.detach())
        golden.add(name + ".dprobs", probs.grad)
        meta(
            name,
            function="switch_load_balancing_loss_func",
            total_num_tokens=total,
            topk=k,
            num_experts=E,
            moe_aux_loss_coeff=0.01,
            dtype="fp32" if dt == torch.float32 else "fp64",
        )

    # z_loss_func(logits, z_loss_coeff[, padding_mask]); loss and d loss / d logits.
    for padded in (False, True):
        name = "fn.z_loss" + ("_padding" if padded else "")
        logits = (torch.randn(24, 8, generator=g) * 3).requires_grad_(True)
        pm = torch.rand(24, generator=g) < 0.3 if padded else None
        loss = mu.z_loss_func(logits, 0.01, padding_mask=pm)
        loss.backward()
        golden.add(name + ".logits", logits.detach())
        if padded:
            golden.add(name + ".padding_mask", pm)
        golden.add(name + ".loss", loss.detach())
        golden.add(name + ".dlogits", logits.grad)
        meta(
            name,
            function="z_loss_func",
            z_loss_coeff=0.01,
            padding_mask_means="True = padding (excluded)" if padded else None,
        )

    # sinkhorn(cost) with its default tol=1e-4.
    for T, E in ((24, 8), (32, 16)):
        name = f"fn.sinkhorn_t{T}_e{E}"
        cost = torch.randn(T, E, generator=g) * 2
        golden.add(name + ".cost", cost)
        golden.add(name + ".out", mu.sinkhorn(cost))
        meta(name, function="sinkhorn", tol=1e-4, dtype="fp32")

    # compute_routing_scores_for_aux_loss(logits, topk, score_function).
    for sf in ("softmax", "sigmoid", "sqrtsoftplus"):
        name = "fn.aux_scores_" + sf
        for attempt in range(MAX_SEED_TRIES):
            logits = torch.randn(24, 16, generator=g) * 2
            rmap, scores = mu.compute_routing_scores_for_aux_loss(logits, 4, sf)
            stable = all(
                torch.equal(
                    rmap,
                    mu.compute_routing_scores_for_aux_loss(
                        logits + PERTURB_EPS * torch.randn(24, 16, generator=g), 4, sf
                    )[0],
                )
                for _ in range(PERTURB_TRIES)
            )
            if stable:
                break
        else:
            raise RuntimeError(name + ": no stable draw")
        golden.add(name + ".logits", logits)
        golden.add(name + ".routing_map", rmap)
        golden.add(name + ".scores", scores)
        meta(name, function="compute_routing_scores_for_aux_loss", topk=4, score_function=sf)

    # group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk).
    for G, gk, k in ((4, 2, 4), (8, 4, 8), (4, 3, 4)):
        name = f"fn.group_limited_topk_g{G}_t{gk}_k{k}"
        for attempt in range(MAX_SEED_TRIES):
            scores = torch.rand(24, 16, generator=g)
            probs, idx = mu.group_limited_topk(scores, k, 24, 16, G, gk)
            stable = all(
                torch.equal(
                    idx.sort(-1).values,
                    mu.group_limited_topk(
                        scores + PERTURB_EPS * torch.randn(24, 16, generator=g), k, 24, 16, G, gk
                    )[1]
                    .sort(-1)
                    .values,
                )
                for _ in range(PERTURB_TRIES)
            )
            if stable:
                break
        else:
            raise RuntimeError(name + ": no stable draw")
        golden.add(name + ".scores", scores)
        golden.add(name + ".probs", probs)
        golden.add(name + ".top_indices", idx)
        meta(
            name,
            function="group_limited_topk",
            topk=k,
            num_tokens=24,
            num_experts=16,
            num_groups=G,
            group_topk=gk,
            note="top_indices/probs in descending order of score (torch.topk sorted)",
        )

    # get_updated_expert_bias(tokens_per_expert [layers, E], expert_bias, rate, group).
    name = "fn.expert_bias_update"
    tpe = torch.tensor([[8, 12, 4, 8, 9, 7, 8, 8], [0, 30, 2, 2, 10, 6, 7, 7]], dtype=torch.float32)
    bias = torch.rand(2, 8, generator=g) * 0.02 - 0.01
    golden.add(name + ".tokens_per_expert", tpe)
    golden.add(name + ".expert_bias", bias)
    golden.add(
        name + ".updated_expert_bias",
        mu.get_updated_expert_bias(
            tpe.clone(), bias.clone(), 1e-3, tp_dp_cp_group=mu.get_default_pg_collection().tp_dp_cp
        ),
    )
    meta(
        name,
        function="get_updated_expert_bias",
        expert_bias_update_rate=1e-3,
        note="row 0 has experts at exactly the mean (sign 0: unchanged)",
    )

    # router_gating_linear(inp, weight, bias=None, router_dtype): bf16 input and weight.
    for rd, rname in ((torch.float32, "fp32"), (torch.float64, "fp64")):
        name = "fn.gating_bf16_" + rname
        x = torch.randn(6, 4, 32, generator=g).bfloat16().requires_grad_(True)
        w = (torch.randn(8, 32, generator=g) * 0.1).bfloat16().requires_grad_(True)
        logits = mu.router_gating_linear(x, w, None, rd)
        up = torch.randn(logits.shape, generator=g, dtype=torch.float64).to(rd)
        (logits * up).sum().backward()
        golden.add(name + ".input", x.detach())
        golden.add(name + ".weight", w.detach())
        golden.add(name + ".logits", logits.detach())
        golden.add(name + ".upstream", up)
        golden.add(name + ".dinput", x.grad)
        golden.add(name + ".dweight", w.grad)
        meta(
            name,
            function="router_gating_linear",
            router_dtype=rname,
            note="input and weight cast to router_dtype, mm; dinput and dweight computed in "
            "router_dtype and cast back to bf16",
        )

    # get_capacity(num_tokens * topk, num_experts, capacity_factor) as apply_router_token_dropping
    # calls it: ceil((T * k / E) * cf) in double. (200, 2, 8, 1.1): 50 * 1.1 = 55.00000000000001,
    # so the capacity is 56, not 55.
    capacity = []
    for T, k, E, cf in (
        (32, 2, 8, 1.0),
        (40, 2, 8, 1.1),
        (32, 2, 8, 1.25),
        (32, 1, 8, 0.5),
        (24, 4, 16, 1.0),
        (30, 3, 16, 1.3),
        (100, 8, 64, 1.0),
        (1000, 6, 48, 0.7),
        (10, 2, 8, 0.1),
        (200, 2, 8, 1.1),
    ):
        capacity.append(
            dict(
                num_tokens=T,
                topk=k,
                num_experts=E,
                capacity_factor=cf,
                expert_capacity=mu.get_capacity(
                    num_tokens=T * k, num_experts=E, capacity_factor=cf
                ),
            )
        )
    return capacity


def moe_layer_freq_table():
    if M.moe_freq_type is None:
        return []
    count = M.moe_logging.MoEMetricsTracker._count_moe_layers
    rows = []
    for arg, num_layers in (
        ("1", 4),
        ("2", 4),
        ("3", 7),
        ("[0]*1+[1]*3", 4),
        ("([1]*3+[0]*1)*3", 12),
        ("([0]+[1]*23)", 24),
        ("[1,0,1,1]", 4),
    ):
        parsed = M.moe_freq_type(arg)
        pattern = (
            parsed
            if isinstance(parsed, list)
            else [1 if i % parsed == 0 else 0 for i in range(num_layers)]
        )
        rows.append(
            dict(
                arg=arg,
                num_layers=num_layers,
                parsed=parsed,
                pattern=pattern,
                num_moe_layers=count(num_layers, parsed, None),
            )
        )
    return rows


# ----------------------------------------------------------------------------------------
# Two-rank cases: global_aux_loss and the expert bias over DP2; seq_aux_loss over TP2
# ----------------------------------------------------------------------------------------

DIST_DP_GLOBAL = dict(
    load_balancing_type="global_aux_loss",
    aux_loss_coeff=0.1,
    micro_batches=2,
    seq_length=8,
    micro_batch_size=2,
)
DIST_DP_BIAS = dict(
    score_function="sigmoid", expert_bias=True, micro_batches=2, seq_length=8, micro_batch_size=2
)
DIST_TP_SEQ = dict(
    load_balancing_type=["aux_loss", "seq_aux_loss"],
    aux_loss_coeff=[0.1, 0.1],
    z_loss_coeff=0.01,
    seq_length=8,
    micro_batch_size=2,
)


def dist_data(seed):
    g = torch.Generator().manual_seed(seed)
    E = 8
    d = {}
    # [rank][mb] logits [S, B, E]: DP ranks hold different sequences.
    d["dp_global"] = [[torch.randn(8, 2, E, generator=g) * 2 for _ in range(2)] for _ in range(2)]
    d["dp_bias"] = [[torch.randn(8, 2, E, generator=g) * 2 for _ in range(2)] for _ in range(2)]
    d["bias"] = (torch.rand(E, generator=g, dtype=torch.float64) * 0.2 - 0.1).float()
    # One micro-batch [S, B, E]; TP rank r holds sequence positions [r*S/2, (r+1)*S/2).
    d["tp_seq"] = torch.randn(8, 2, E, generator=g) * 2
    return d


def run_aux_only(spec, logits_mbs, bias=None, check_stable=False):
    """Routes the micro-batches through one router and returns, per micro-batch, the
    routing map, the injected losses and d/dlogits of the injected losses alone."""
    data = {
        "mb": [
            {"logits": lg, "upstream": torch.zeros(lg.shape[0] * lg.shape[1], lg.shape[2])}
            for lg in logits_mbs
        ]
    }
    if bias is not None:
        data["expert_bias"] = bias
    if check_stable and not is_stable(spec, data, BASE_SEED):
        raise RuntimeError(
            f"{spec['name']}: routing not stable; change the seed in emit_dist_cases"
        )
    return run_router(spec, data)


def _dist_worker(rank, world, init_file, megatron_path, seed, out_dir):
    import_megatron(megatron_path)
    init_distributed(init_file, rank, world, tp=1)
    d = dist_data(seed)
    out = {}
    spec = case("dist.dp2_global", **DIST_DP_GLOBAL)
    out["dp_global"] = run_aux_only(spec, d["dp_global"][rank])
    spec = case("dist.dp2_bias", **DIST_DP_BIAS)
    out["dp_bias"] = run_aux_only(spec, d["dp_bias"][rank], bias=d["bias"])
    reinit_model_parallel(tp=2)
    spec = case("dist.tp2_seq", **DIST_TP_SEQ)
    shard = d["tp_seq"][rank * 4 : (rank + 1) * 4]
    out["tp_seq"] = run_aux_only(spec, [shard])
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def emit_dist_cases(golden, megatron_path):
    seed = BASE_SEED + 777
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _dist_worker,
            args=(2, os.path.join(tmp, "init"), megatron_path, seed, tmp),
            nprocs=2,
            join=True,
        )
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    d = dist_data(seed)

    # global_aux_loss, DP2 x 2 micro-batches vs one rank whose micro-batch m is both ranks'
    # micro-batch m (batch dimension concatenated).
    name = "dist.dp2_global"
    spec = case(name, **DIST_DP_GLOBAL)
    one = run_aux_only(
        spec,
        [torch.cat([d["dp_global"][0][m], d["dp_global"][1][m]], dim=1) for m in range(2)],
        check_stable=True,
    )
    for m in range(2):
        for r in range(2):
            rr = ranks[r]["dp_global"]["mb"][m]
            golden.add(f"{name}.rank{r}.mb{m}.logits", d["dp_global"][r][m])
            golden.add(f"{name}.rank{r}.mb{m}.dlogits_aux", rr["dlogits_aux"])
            golden.add(f"{name}.rank{r}.mb{m}.loss.global_aux_loss", rr["loss.global_aux_loss"])
            golden.add(
                f"{name}.rank{r}.mb{m}.global_tokens_per_expert", rr["global_tokens_per_expert"]
            )
            # Per token, a DP rank's gradient equals the one-rank gradient: the DP average of
            # the weight gradients then divides the global aux loss's gradient by DP.
            torch.testing.assert_close(
                rr["dlogits_aux"],
                one["mb"][m]["dlogits_aux"][:, 2 * r : 2 * r + 2],
                rtol=1e-5,
                atol=1e-8,
            )
        golden.add(f"{name}.onerank.mb{m}.dlogits_aux", one["mb"][m]["dlogits_aux"])
        golden.add(
            f"{name}.onerank.mb{m}.loss.global_aux_loss", one["mb"][m]["loss.global_aux_loss"]
        )
    for r in range(2):
        for k, v in ranks[r]["dp_global"]["logged"].items():
            golden.add(f"{name}.rank{r}.logged.{k}", torch.tensor(v, dtype=torch.float64))
    for k, v in one["logged"].items():
        golden.add(f"{name}.onerank.logged.{k}", torch.tensor(v, dtype=torch.float64))
        assert math.isclose(v, ranks[0]["dp_global"]["logged"][k], rel_tol=1e-5), (k, v)
    golden.cases[name] = dict(
        spec_without_name(spec),
        world_size=2,
        data_parallel_size=2,
        layout="rank r, micro-batch m: logits [S=8, B=2, E=8]; onerank micro-batch m = cat "
        "over ranks along B",
        aux_loss_backward_scale=backward_scale(spec),
        relation="rank r dlogits_aux == onerank dlogits_aux[:, 2r:2r+2] (asserted). Megatron "
        "then averages the router weight gradients over DP, so its global_aux_loss gradient is "
        "1/DP of the one-rank one.",
        tensors=sorted(n for n in golden.tensors if n.startswith(name + ".")),
    )

    # Expert bias over DP2: counts summed over TP x DP x CP by get_updated_expert_bias.
    name = "dist.dp2_bias"
    spec = case(name, **DIST_DP_BIAS)
    one = run_aux_only(
        spec,
        [torch.cat([d["dp_bias"][0][m], d["dp_bias"][1][m]], dim=1) for m in range(2)],
        bias=d["bias"],
        check_stable=True,
    )
    golden.add(f"{name}.expert_bias", d["bias"])
    for r in range(2):
        for m in range(2):
            golden.add(f"{name}.rank{r}.mb{m}.logits", d["dp_bias"][r][m])
        golden.add(
            f"{name}.rank{r}.local_tokens_per_expert",
            ranks[r]["dp_bias"]["local_tokens_per_expert"],
        )
        golden.add(
            f"{name}.rank{r}.updated_expert_bias", ranks[r]["dp_bias"]["updated_expert_bias"]
        )
        torch.testing.assert_close(
            ranks[r]["dp_bias"]["updated_expert_bias"], one["updated_expert_bias"], rtol=0, atol=0
        )
    golden.add(f"{name}.onerank.local_tokens_per_expert", one["local_tokens_per_expert"])
    golden.add(f"{name}.onerank.updated_expert_bias", one["updated_expert_bias"])
    golden.cases[name] = dict(
        spec_without_name(spec),
        world_size=2,
        data_parallel_size=2,
        relation="each rank's updated_expert_bias == onerank's (asserted, exact)",
        tensors=sorted(n for n in golden.tensors if n.startswith(name + ".")),
    )

    # seq_aux_loss + aux_loss + z-loss over TP2 (sequence-parallel shards of one micro-batch).
    name = "dist.tp2_seq"
    spec = case(name, **DIST_TP_SEQ)
    one = run_aux_only(spec, [d["tp_seq"]], check_stable=True)
    golden.add(f"{name}.logits", d["tp_seq"])
    golden.add(f"{name}.onerank.dlogits_aux", one["mb"][0]["dlogits_aux"])
    for k in ("loss.z_loss", "loss.aux_loss", "loss.seq_aux_loss"):
        golden.add(f"{name}.onerank.{k}", one["mb"][0][k])
    for r in range(2):
        rr = ranks[r]["tp_seq"]["mb"][0]
        golden.add(f"{name}.rank{r}.dlogits_aux", rr["dlogits_aux"])
        for k in ("loss.z_loss", "loss.aux_loss", "loss.seq_aux_loss"):
            golden.add(f"{name}.rank{r}.{k}", rr[k])
        torch.testing.assert_close(
            rr["dlogits_aux"], one["mb"][0]["dlogits_aux"][4 * r : 4 * r + 4], rtol=1e-5, atol=1e-8
        )
        for k, v in ranks[r]["tp_seq"]["logged"].items():
            golden.add(f"{name}.rank{r}.logged.{k}", torch.tensor(v, dtype=torch.float64))
    for k, v in one["logged"].items():
        golden.add(f"{name}.onerank.logged.{k}", torch.tensor(v, dtype=torch.float64))
        assert math.isclose(v, ranks[0]["tp_seq"]["logged"][k], rel_tol=1e-5), (k, v)
    golden.cases[name] = dict(
        spec_without_name(spec),
        world_size=2,
        tensor_model_parallel_size=2,
        layout="logits [S=8, B=2, E=8]; TP rank r routes positions [4r, 4r+4) (sequence parallel)",
        aux_loss_backward_scale=backward_scale(spec),
        relation="rank r dlogits_aux == onerank dlogits_aux[4r:4r+4] (asserted); per-rank "
        "losses sum to the one-rank loss for aux/seq_aux (z-loss: per-rank coeff is coeff / TP)",
        tensors=sorted(n for n in golden.tensors if n.startswith(name + ".")),
    )


def spec_without_name(spec):
    return {k: v for k, v in spec.items() if k not in ("name", "logit_scale")}


# ----------------------------------------------------------------------------------------


def file_sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def megatron_commit(path, given):
    if given:
        return given
    try:
        return subprocess.run(
            ["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--megatron", required=True, help="path of a Megatron-LM checkout")
    ap.add_argument(
        "--megatron-commit",
        default=None,
        help="recorded in the metadata (default: git rev-parse HEAD in --megatron)",
    )
    ap.add_argument(
        "--out",
        default=os.path.join(
            os.path.dirname(os.path.abspath(__file__)),
            "..",
            "tests",
            "golden",
            "router_golden.safetensors",
        ),
    )
    ap.add_argument("--no-dist", action="store_true", help="skip the two-rank cases")
    args = ap.parse_args()

    import_megatron(args.megatron)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        init_distributed(os.path.join(tmp, "init"), 0, 1, tp=1)
        golden = Golden()
        for i, spec in enumerate(router_cases()):
            emit_router_case(golden, spec, i)
            print(f"{spec['name']}: seed {golden.cases[spec['name']]['seed']}")
        capacity = emit_function_cases(golden)
        freq = moe_layer_freq_table()
        if not args.no_dist:
            emit_dist_cases(golden, M.path)

    moe = os.path.join(M.path, "megatron/core/transformer/moe")
    info = {
        "format": "see tools/make_router_golden.py; f64_tensors are float64 stored as I64 bit "
        "patterns; booleans as I32 0/1; scalars as shape [1]",
        "megatron": {
            "commit": megatron_commit(M.path, args.megatron_commit),
            "router.py sha256": file_sha256(os.path.join(moe, "router.py")),
            "moe_utils.py sha256": file_sha256(os.path.join(moe, "moe_utils.py")),
            "moe_logging.py sha256": file_sha256(os.path.join(moe, "moe_logging.py")),
        },
        "torch": torch.__version__,
        "cases": golden.cases,
        "f64_tensors": golden.f64,
        "capacity": capacity,
        "moe_layer_freq": freq,
    }
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    text = json.dumps(info, indent=1, sort_keys=True)
    save_file(golden.tensors, out, metadata={"golden": json.dumps(info, sort_keys=True)})
    os.chmod(out, 0o644)  # save_file creates the file 0600
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        f.write(text + "\n")
    size = os.path.getsize(out)
    print(f"wrote {out}: {len(golden.tensors)} tensors, {len(golden.cases)} cases, {size} bytes")


if __name__ == "__main__":
    main()
