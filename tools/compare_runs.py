"""Compares two training runs of the same config under different parallel layouts.

Usage: python3 tools/compare_runs.py REF_DIR RUN_DIR [--rtol 1e-5] [--resumed]
       [--num-zeros-atol 0]
Each DIR holds `metrics.jsonl` (written by `megaton train --log-metrics-file`) and a
checkpoint directory `save/` (`--save`). Checks, for every iteration, that the lm loss,
the grad norm, (MoE) the load-balancing loss and (--log-params-norm) the params norm agree to a relative difference <= rtol, and that every parameter of the
last checkpoint ("model.*" tensors, fp32) agrees as a whole tensor: ||a - b|| / ||b|| <=
rtol; the logged zero count exactly (--num-zeros-atol: within that many elements). --resumed: RUN_DIR resumed from a checkpoint, so it logged only the later
iterations (each must be in the reference). Prints the worst differences; exits 1 when a check fails, 2 on unreadable input.
Pure Python (no numpy): the CI machine runs it.
"""
import argparse, array, json, math, os, struct, sys


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, entry in header.items():
        if name == "__metadata__" or not name.startswith("model."):
            continue
        if entry["dtype"] != "F32":
            sys.exit(f"compare_runs: {path}: {name} is {entry['dtype']}, expected F32")
        begin, end = entry["data_offsets"]
        values = array.array("f")
        values.frombytes(data[begin:end])
        out[name] = values
    return out


def read_sharded(iteration_dir, metadata):
    """The "model.*" tensors of a sharded checkpoint (src/ckpt/sharded.h), assembled from
    the ranks' pieces: each piece is a box of the global tensor at `offsets`, restricted to
    `flat_range` of the box in row-major order."""
    out = {}
    files = {}
    for name, entry in metadata["sharded_tensors"].items():
        if not name.startswith("model."):
            continue
        if entry["dtype"] != "F32":
            sys.exit(f"compare_runs: {iteration_dir}: {name} is {entry['dtype']}, expected F32")
        shape = entry["global_shape"]
        numel = 1
        for d in shape:
            numel *= d
        values = array.array("f", bytes(4 * numel))
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        for piece in entry["pieces"]:
            if piece["file"] not in files:
                with open(os.path.join(iteration_dir, piece["file"]), "rb") as f:
                    files[piece["file"]] = f.read()
            begin, end = piece["flat_range"]
            data = array.array("f")
            data.frombytes(files[piece["file"]][piece["byte_offset"]:piece["byte_offset"] + 4 * (end - begin)])
            box, offsets = piece["box_shape"], piece["offsets"]
            for k in range(begin, end):
                rest, g = k, 0
                for i in range(len(box) - 1, -1, -1):
                    g += (rest % box[i] + offsets[i]) * strides[i]
                    rest //= box[i]
                values[g] = data[k - begin]
        out[name] = values
    return out


def read_checkpoint(save_dir):
    """The last checkpoint's "model.*" tensors, either format."""
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        it = int(f.read().strip())
    iteration_dir = os.path.join(save_dir, f"iter_{it:07d}")
    with open(os.path.join(iteration_dir, "metadata.json")) as f:
        metadata = json.load(f)
    if metadata.get("checkpoint_format") == "megaton_sharded":
        return read_sharded(iteration_dir, metadata)
    return read_safetensors(os.path.join(iteration_dir, "model_optim_rng.safetensors"))


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ref")
    p.add_argument("run")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--resumed", action="store_true")
    # BF16 main grads: two bf16 partial sums that cancel give an exact zero, so where the
    # rounding points differ (DP halves, TP sums) the zero count moves with them.
    p.add_argument("--num-zeros-atol", type=int, default=0)
    a = p.parse_args()
    try:
        ref_m = read_metrics(os.path.join(a.ref, "metrics.jsonl"))
        run_m = read_metrics(os.path.join(a.run, "metrics.jsonl"))
        ref_w = read_checkpoint(os.path.join(a.ref, "save"))
        run_w = read_checkpoint(os.path.join(a.run, "save"))
    except (OSError, ValueError, KeyError) as e:
        print(f"compare_runs: {e}")
        sys.exit(2)
    failures = []
    ref_by_it = {r["iteration"]: r for r in ref_m}
    run_its = [m["iteration"] for m in run_m]
    if not run_m or any(it not in ref_by_it for it in run_its) or (
            not a.resumed and sorted(run_its) != sorted(ref_by_it)):
        failures.append(f"iterations logged {run_its}, reference {sorted(ref_by_it)}")
    worst = {"lm loss": 0.0, "grad norm": 0.0, "load-balancing loss": 0.0, "params norm": 0.0,
             "params": 0.0}
    moe_keys = (("seq_load_balancing_loss", "seq load-balancing loss"),
                ("global_load_balancing_loss", "global load-balancing loss"),
                ("z_loss", "z-loss"), ("moe_expert_imbalance", "expert imbalance"),
                ("mtp_1_loss", "mtp_1 loss"), ("mtp_2_loss", "mtp_2 loss"))
    for _, name in moe_keys:
        worst[name] = 0.0
    for m in run_m:
        r = ref_by_it.get(m["iteration"])
        if r is None:
            continue
        for key, name in (("lm_loss", "lm loss"), ("grad_norm", "grad norm"),
                          ("load_balancing_loss", "load-balancing loss"),
                          ("params_norm", "params norm")) + moe_keys:
            if key not in r and key not in m:
                continue
            if key not in r or key not in m:
                failures.append(f"iteration {r['iteration']}: {name} logged by one run only")
                continue
            d = rel(m[key], r[key])
            worst[name] = max(worst[name], d)
            if not d <= a.rtol:
                failures.append(f"iteration {r['iteration']}: {name} {m[key]!r} vs {r[key]!r} "
                                f"(relative {d:.2e})")
        # The loss scale and the skips follow from whether any gradient overflowed, which
        # every rank agrees on: equal exactly.
        for key in ("loss_scale", "skipped", "global_batch_size", "consumed_samples"):
            if r.get(key) != m.get(key):
                failures.append(f"iteration {r['iteration']}: {key} {m.get(key)!r} vs "
                                f"{r.get(key)!r}")
        # Counted once per distinct element on any layout: equal exactly (unless
        # --num-zeros-atol allows |run - ref| <= atol elements).
        if ("num_zeros" in r) != ("num_zeros" in m):
            failures.append(f"iteration {r['iteration']}: num zeros logged by one run only")
        elif "num_zeros" in r and not (
                abs(r["num_zeros"] - m["num_zeros"]) <= a.num_zeros_atol):
            failures.append(f"iteration {r['iteration']}: num zeros {m['num_zeros']} vs "
                            f"{r['num_zeros']}")
    if set(ref_w) != set(run_w):
        failures.append(f"parameter names differ: only in reference {sorted(set(ref_w) - set(run_w))[:3]}, "
                        f"only in run {sorted(set(run_w) - set(ref_w))[:3]}")
    for name in sorted(set(ref_w) & set(run_w)):
        x, y = run_w[name], ref_w[name]
        if len(x) != len(y):
            failures.append(f"{name}: {len(x)} elements vs {len(y)}")
            continue
        diff = math.sqrt(sum((u - v) ** 2 for u, v in zip(x, y)))
        norm = math.sqrt(sum(v * v for v in y))
        d = diff / max(norm, 1e-30)
        worst["params"] = max(worst["params"], d)
        if not d <= a.rtol:
            failures.append(f"{name}: relative difference {d:.2e}")
    print("worst relative differences: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()
                                                     if v > 0 or k in ("lm loss", "params")))
    for f in failures[:20]:
        print("FAILED: " + f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
