// OptimizerOffload: the host half of an AdamW under --optimizer-cpu-offload.
#include "optim/optimizer_offload.h"

#include "core/error.h"
#include "ops/adam_precision.h"
#include "ops/ops.h"
#include "optim/adamw.h"

namespace megaton::optim {

std::vector<uint8_t> choose_offloaded_params(const std::vector<Param*>& params, double fraction) {
  double total = 0;
  for (const Param* p : params) total += double(p->weight.numel());
  const double threshold = total * fraction;
  std::vector<uint8_t> out(params.size(), 0);
  double offloaded = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!(offloaded < threshold)) break;
    out[i] = 1;
    offloaded += double(params[i]->weight.numel());
  }
  return out;
}

namespace {
constexpr size_t kAlign = 64;
size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
}  // namespace

OptimizerOffload::OptimizerOffload(const std::vector<Param*>& params,
                                   const std::vector<uint8_t>& offloaded, const AdamWConfig& config,
                                   std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq)
    : device_(params.empty() ? Device::CPU : params[0]->weight.device()), host_(device_) {
  MEGATON_CHECK(offloaded.size() == params.size() && exp_avg.size() == params.size() &&
                    exp_avg_sq.size() == params.size(),
                "OptimizerOffload: {} flags and {}/{} moments for {} params", offloaded.size(),
                exp_avg.size(), exp_avg_sq.size(), params.size());
  const size_t avg_b = dtype_size(config.exp_avg_dtype), sq_b = dtype_size(config.exp_avg_sq_dtype);
  // One pinned block: per param its master, grad, moments and compute copy, then control.
  size_t bytes = aligned(ops::kAdamControlSize * 4);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!offloaded[i]) continue;
    const Param* p = params[i];
    // The host update reads a BF16 main grad (--main-grads-dtype bf16) as the device's does.
    MEGATON_CHECK(p->main_grad.defined() &&
                      (p->main_grad.dtype() == DType::F32 || p->main_grad.dtype() == DType::BF16) &&
                      p->main_grad.device() == p->weight.device(),
                  "offloaded param '{}' needs an fp32 or bf16 main_grad on its device", p->name);
    const size_t n = size_t(p->weight.numel());
    const size_t grad_b = dtype_size(p->main_grad.dtype());
    const size_t copy_b = p->weight.dtype() == DType::F32 ? 0 : dtype_size(p->weight.dtype());
    bytes += aligned(4 * n) + aligned(grad_b * n) + aligned(avg_b * n) + aligned(sq_b * n) +
             aligned(copy_b * n);
  }
  host_.reserve(bytes);
  stream_ = std::make_unique<HostCopyStream>(device_);
  std::byte* at = host_.data();
  auto take = [&at](const Shape& shape, DType dtype) {
    Tensor t = Tensor::borrow(at, shape, dtype, Device::CPU);
    at += aligned(size_t(t.numel()) * dtype_size(dtype));
    return t;
  };
  control_ = take({ops::kAdamControlSize}, DType::F32);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!offloaded[i]) continue;
    Param* p = params[i];
    const Shape& shape = p->weight.shape();
    Tensor master = take(shape, DType::F32);
    master.copy_from(main_param_value(*p));  // joined from a remainder, or the fp32 weight
    p->main_param = master;
    p->main_param_remainder = Tensor();
    grads_.push_back(take(shape, p->main_grad.dtype()));
    exp_avg[i] = take(shape, config.exp_avg_dtype);
    exp_avg[i].zero();
    exp_avg_sq[i] = take(shape, config.exp_avg_sq_dtype);
    exp_avg_sq[i].zero();
    copies_.push_back(p->weight.dtype() == DType::F32 ? Tensor() : take(shape, p->weight.dtype()));
    params_.push_back(p);
    index_.push_back(i);
    numel_ += p->weight.numel();
  }
}

OptimizerOffload::~OptimizerOffload() {
  if (stream_) stream_->synchronize();
}

void OptimizerOffload::start(const Tensor& control) {
  if (empty()) return;
  with_control_ = control.defined();
  stream_->wait_for_compute();
  for (size_t k = 0; k < params_.size(); ++k)
    stream_->copy_to_host(static_cast<std::byte*>(grads_[k].raw()), params_[k]->main_grad);
  if (with_control_) stream_->copy_to_host(static_cast<std::byte*>(control_.raw()), control);
  stream_->record(copied_in_);
}

void OptimizerOffload::finish(const std::vector<float>& weight_decays,
                              const std::vector<ops::MomentRoundingKey>& keys,
                              const std::vector<Tensor>& exp_avg,
                              const std::vector<Tensor>& exp_avg_sq, float beta1, float beta2,
                              float eps, float lr, int64_t step, float grad_scale) {
  if (empty()) return;
  stream_->synchronize();  // the grads (and control) are on the host
  std::vector<Tensor> masters, grads = grads_, m, v, copies = copies_;
  std::vector<float> wd;
  std::vector<ops::MomentRoundingKey> k;
  for (size_t j = 0; j < params_.size(); ++j) {
    const size_t i = index_[j];
    masters.push_back(params_[j]->main_param);
    m.push_back(exp_avg[i]);
    v.push_back(exp_avg_sq[i]);
    wd.push_back(weight_decays[i]);
    k.push_back(keys[i]);
  }
  if (with_control_) {
    if (control_.f32()[ops::kAdamSkip] != 0.0f) return;  // nothing changed, nothing to copy
    ops::multi_tensor_adamw(masters, grads, m, v, copies, wd, beta1, beta2, eps, control_, k);
  } else {
    ops::multi_tensor_adamw(masters, grads, m, v, copies, wd, lr, beta1, beta2, eps, step,
                            grad_scale, k);
  }
  // The weights the next forward reads: after the device's own update, before anything
  // queued later (the parameter all-gather, the next forward).
  stream_->wait_for_compute();
  for (size_t j = 0; j < params_.size(); ++j) {
    const Tensor& src = copies_[j].defined() ? copies_[j] : params_[j]->main_param;
    stream_->copy_to_device(params_[j]->weight, static_cast<const std::byte*>(src.raw()));
  }
  stream_->record(copied_out_);
  stream_->compute_waits(copied_out_);
}

}  // namespace megaton::optim
