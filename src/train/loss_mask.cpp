// The loss mask of --eod-mask-loss (train/loss_mask.h).
#include "train/loss_mask.h"

#include "core/error.h"

namespace megaton {

LossMask eod_loss_mask(const Tensor& tokens, int32_t eod) {
  MEGATON_CHECK(tokens.dtype() == DType::I32 && tokens.device() == Device::CPU,
                "eod_loss_mask: tokens must be I32 on the host");
  const int64_t n = tokens.numel();
  LossMask out;
  out.mask = Tensor::empty({n}, DType::F32);
  out.weights = Tensor::empty({n}, DType::F32);
  const int32_t* ids = tokens.i32();
  float* mask = out.mask.f32();
  for (int64_t t = 0; t < n; ++t) {
    mask[t] = ids[t] == eod ? 0.0f : 1.0f;
    out.num_tokens += ids[t] == eod ? 0 : 1;
  }
  const float inv_tokens = out.num_tokens > 0 ? float(1.0 / double(out.num_tokens)) : 0.0f;
  float* weights = out.weights.f32();
  for (int64_t t = 0; t < n; ++t) weights[t] = mask[t] * inv_tokens;
  return out;
}

double masked_loss_sum(const Tensor& losses, const Tensor& mask) {
  MEGATON_CHECK(losses.dtype() == DType::F32 && mask.dtype() == DType::F32 &&
                    losses.numel() == mask.numel() && mask.device() == Device::CPU,
                "masked_loss_sum: losses {} and mask {} must be F32 of one size, the mask on "
                "the host",
                shape_str(losses.shape()), shape_str(mask.shape()));
  const Tensor host = losses.device() == Device::CPU ? losses : losses.to(Device::CPU);
  double sum = 0;
  for (int64_t t = 0; t < host.numel(); ++t) sum += double(host.f32()[t]) * double(mask.f32()[t]);
  return sum;
}

}  // namespace megaton
