// ParamAndGradBuffer layout and piece lookup.
#include "model/param_buffer.h"

#include <algorithm>

#include "core/error.h"

namespace megaton {

namespace {
constexpr int64_t kAlign = 64;  // elements: 256 bytes of fp32, 128 of bf16
int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
const char* device_name(Device d) { return d == Device::CUDA ? "cuda" : "cpu"; }
}  // namespace

ParamAndGradBuffer::ParamAndGradBuffer(std::vector<Param*> params, int64_t num_shards,
                                       bool is_expert)
    : params_(std::move(params)), num_shards_(num_shards), is_expert_(is_expert) {
  MEGATON_CHECK(num_shards >= 1, "ParamAndGradBuffer: {} shards", num_shards);
  MEGATON_CHECK(!params_.empty(), "ParamAndGradBuffer: no params");
  const DType dtype = params_[0]->weight.dtype();
  const Device device = params_[0]->weight.device();
  int64_t total = 0;
  for (const Param* p : params_) {
    MEGATON_CHECK(p->weight.dtype() == dtype && p->weight.device() == device,
                  "ParamAndGradBuffer: param '{}' is {} on {}, the first {} on {}", p->name,
                  dtype_name(p->weight.dtype()), device_name(p->weight.device()),
                  dtype_name(dtype), device_name(device));
    offsets_.push_back(total);
    total += round_up(p->weight.numel(), kAlign);
  }
  total = round_up(std::max<int64_t>(total, 1), kAlign * num_shards);
  weights_ = Tensor::zeros({total}, dtype, device);
  grads_ = Tensor::zeros({total}, DType::F32, device);
  for (size_t i = 0; i < params_.size(); ++i) {
    Param* p = params_[i];
    const bool main_is_weight = p->main_param.defined() && p->main_param.raw() == p->weight.raw();
    Tensor view = weights_.rows(offsets_[i], p->weight.numel()).view(p->weight.shape());
    view.copy_from(p->weight);
    p->weight = view;
    if (main_is_weight) p->main_param = view;
    p->main_grad = grads_.rows(offsets_[i], p->weight.numel()).view(p->weight.shape());
  }
}

std::vector<BufferPiece> ParamAndGradBuffer::pieces(int64_t begin, int64_t end) const {
  std::vector<BufferPiece> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t start = offsets_[i], stop = start + params_[i]->weight.numel();
    const int64_t lo = std::max(start, begin), hi = std::min(stop, end);
    if (lo < hi) out.push_back({params_[i], lo - start, lo, hi - lo});
  }
  return out;
}

}  // namespace megaton
