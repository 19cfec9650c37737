// The loss mask of --eod-mask-loss (train/loss_mask.h).
#include "train/loss_mask.h"

#include "core/error.h"
#include "model/context_parallel.h"

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

LossMask eod_loss_mask(const Tensor& whole_tokens, int32_t eod, int cp, int cp_rank) {
  if (cp == 1) return eod_loss_mask(whole_tokens, eod);
  MEGATON_CHECK(whole_tokens.ndim() == 2, "eod_loss_mask: tokens must be [B, S], got {}",
                shape_str(whole_tokens.shape()));
  const LossMask whole = eod_loss_mask(whole_tokens, eod);
  LossMask out;
  out.mask = cp_split_sequence(whole.mask.view(whole_tokens.shape()), cp, cp_rank)
                 .view({whole.mask.numel() / cp});
  out.weights = Tensor::empty(out.mask.shape(), DType::F32);
  const float w = whole.num_tokens > 0 ? float(double(cp) / double(whole.num_tokens)) : 0.0f;
  for (int64_t t = 0; t < out.mask.numel(); ++t) {
    out.weights.f32()[t] = out.mask.f32()[t] * w;
    out.num_tokens += out.mask.f32()[t] > 0.0f ? 1 : 0;
  }
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
