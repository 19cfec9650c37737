#!/usr/bin/env python3
"""Golden FP8 casts for Megaton's quantizer (ops/fp8.h), produced by PyTorch's own casts.

For seeded fp32 and bf16 inputs and a few given scales, computes what Transformer
Engine's per-tensor quantization stores,

    q = saturate(x.float() * scale).to(torch.float8_e4m3fn / torch.float8_e5m2)

and writes the inputs, the scales and the FP8 bit patterns. tests/ops/test_ops_fp8.cpp
(Fp8Golden) quantizes the same inputs with ops::fp8_quantize and compares bit for bit.
Run

    python tools/make_fp8_golden.py [--out tests/golden/fp8_golden.safetensors]

with torch 2.15 and safetensors (tools/requirements-golden.txt). The tests do not need it.

Why the clamp before the cast: TE's cast saturates (+-inf and finite values beyond the
format's largest finite value become +-448 or +-57344), torch's plain cast does not
everywhere: to float8_e5m2 it rounds 61440 and above to inf (torch 2.15, measured), and
older torch releases turned out-of-range values cast to float8_e4m3fn into NaN. So the
script clamps the fp32 product to [-max, max] first (torch.clamp keeps NaN), which makes
the cast TE's. The product is fp32 (x.float() times a float32 scale tensor), as in
fp8.h. NaN keeps its sign through the multiply, the clamp and torch's cast (0x7F / 0xFF
in both formats), as fp8.h's quantizer does.

Inputs (x: F32 [64, 64], x_bf16: BF16 [32, 32]), in a seeded random order:
  - specials: +-0, +-inf, +-NaN, +-FLT_MAX, +-FLT_MIN, fp32 subnormals, values around
    both formats' largest finite value and the round-to-inf boundary;
  - every finite value of both FP8 formats, both signs;
  - every midpoint between neighbouring values of both formats (the ties: they stay ties
    under the power-of-two scales below), and the fp32 neighbours of each midpoint;
  - log-uniform random values over 2^-30 .. 2^20 (both formats' subnormal ranges
    included after scaling) filling the rest.
Scales ("scales", F32 [S]): powers of two (ties stay ties), and ones whose products round
in fp32 (3, 448 / 5.3, 0.1).

Output tensors:
  x, x_bf16, scales
  e4m3.<s>, e5m2.<s>            F8_E4M3 / F8_E5M2 [64, 64]: the casts of x * scales[s]
  bf16.e4m3.<s>, bf16.e5m2.<s>  [32, 32]: the casts of x_bf16 * scales[s]
and metadata "golden" (JSON: torch version, seed, scales, tensor names).
"""
import argparse
import json
import math

import torch
from safetensors.torch import save_file

SEED = 20250607
SCALES = [1.0, 2.0**-7, 2.0**10, 3.0, 448.0 / 5.3, 0.1]
FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def finite_positive_values(dtype):
    """Every finite positive value of an FP8 dtype, ascending (fp32)."""
    values = torch.arange(128, dtype=torch.uint8).view(dtype).float()
    return values[torch.isfinite(values)].sort().values


def tie_values():
    out = []
    for dtype, _ in FORMATS.values():
        grid = finite_positive_values(dtype)  # starts at 0
        mids = (grid[:-1] + grid[1:]) / 2  # exact in fp32: a few significant bits
        out += [grid, mids, torch.nextafter(mids, torch.tensor(math.inf)),
                torch.nextafter(mids, torch.tensor(0.0))]
    pos = torch.cat(out)
    return torch.cat([pos, -pos])


def special_values():
    f32 = torch.finfo(torch.float32)
    pos = [0.0, math.inf, math.nan, f32.max, f32.tiny, 2.0**-149, 2.0**-130, 1e-40,
           448.0, 449.0, 464.0, 479.0, 480.0, 481.0, 1e4, 57344.0, 59000.0, 61439.0,
           61440.0, 65536.0, 1e6, 1e30]
    t = torch.tensor(pos, dtype=torch.float32)
    return torch.cat([t, -t])


def log_uniform(n, gen):
    exponent = torch.empty(n).uniform_(-30.0, 20.0, generator=gen)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    return (sign * torch.exp2(exponent)).float()


def quantize(x, scale, dtype, max_value):
    product = x.float() * torch.tensor(scale, dtype=torch.float32)
    return torch.clamp(product, -max_value, max_value).to(dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tests/golden/fp8_golden.safetensors")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(SEED)

    fixed = torch.cat([special_values(), tie_values()])
    n = 64 * 64
    assert fixed.numel() <= n, fixed.numel()
    x = torch.cat([fixed, log_uniform(n - fixed.numel(), gen)])
    x = x[torch.randperm(n, generator=gen)].reshape(64, 64).contiguous()

    m = 32 * 32
    bf16_fixed = special_values().bfloat16()
    x_bf16 = torch.cat([bf16_fixed, log_uniform(m - bf16_fixed.numel(), gen).bfloat16()])
    x_bf16 = x_bf16[torch.randperm(m, generator=gen)].reshape(32, 32).contiguous()

    scales = torch.tensor(SCALES, dtype=torch.float32)
    out = {"x": x, "x_bf16": x_bf16, "scales": scales}
    for s in range(len(SCALES)):
        scale = scales[s].item()
        for name, (dtype, max_value) in FORMATS.items():
            out[f"{name}.{s}"] = quantize(x, scale, dtype, max_value)
            out[f"bf16.{name}.{s}"] = quantize(x_bf16, scale, dtype, max_value)

    # The cast keeps NaN's sign (what the C++ test expects of the quantizer).
    for name in FORMATS:
        bits = out[f"{name}.0"].view(torch.uint8)
        nan = torch.isnan(x)
        expected = torch.where(torch.signbit(x[nan]), 0xFF, 0x7F).to(torch.uint8)
        assert torch.equal(bits[nan], expected), (name, bits[nan])

    meta = {"format": "megaton-fp8-golden-1", "torch_version": torch.__version__, "seed": SEED,
            "scales": scales.tolist(), "tensors": sorted(out)}
    save_file(out, args.out, metadata={"golden": json.dumps(meta)})
    print(f"wrote {args.out}: {len(out)} tensors, {len(fixed)} fixed and "
          f"{n - len(fixed)} random fp32 inputs, {m} bf16 inputs, scales {SCALES}")


if __name__ == "__main__":
    main()
