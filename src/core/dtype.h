// DType: the element types Megaton stores, their sizes, names and scalar conversions.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace megaton {

// I16: raw 16-bit integers; the optimizer keeps the low halves of fp32 main params in it
// (ops/param_remainder.h, Transformer Engine's store_param_remainders).
enum class DType : uint8_t { F32, BF16, F16, F8E4M3, F8E5M2, I32, I64, I16 };

// Bytes per element.
size_t dtype_size(DType t);
// Lower-case name as in safetensors/PyTorch style: "F32", "BF16", "F16", "F8_E4M3",
// "F8_E5M2", "I32", "I64", "I16" (the safetensors dtype strings).
std::string_view dtype_name(DType t);
// Inverse of dtype_name; throws megaton::Error on an unknown name.
DType dtype_from_name(std::string_view name);
bool is_floating(DType t);

// Scalar conversions between fp32 and the 16/8-bit float formats. Rounding is
// round-to-nearest-even. bf16/fp16 keep inf and NaN. FP8 follows the OCP FP8 spec
// (as in NVIDIA Transformer Engine): e4m3 has no inf, saturates to +-448 and maps NaN to
// 0x7F; e5m2 saturates to +-57344 (inf stays inf, NaN stays NaN).
uint16_t float_to_bf16(float f);
float bf16_to_float(uint16_t h);
uint16_t float_to_fp16(float f);
float fp16_to_float(uint16_t h);
uint8_t float_to_fp8e4m3(float f);
float fp8e4m3_to_float(uint8_t v);
uint8_t float_to_fp8e5m2(float f);
float fp8e5m2_to_float(uint8_t v);

}  // namespace megaton
