// ParamAndGradBuffer layout, buckets and piece lookup.
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
                                       bool is_expert, int64_t bucket_size,
                                       const std::vector<const Param*>& own_bucket,
                                       DType grad_dtype)
    : params_(std::move(params)), num_shards_(num_shards), is_expert_(is_expert) {
  MEGATON_CHECK(num_shards >= 1, "ParamAndGradBuffer: {} shards", num_shards);
  MEGATON_CHECK(!params_.empty(), "ParamAndGradBuffer: no params");
  MEGATON_CHECK(grad_dtype == DType::F32 || grad_dtype == DType::BF16,
                "ParamAndGradBuffer: grads must be F32 or BF16, got {}", dtype_name(grad_dtype));
  const bool fp8 = params_[0]->fp8_param;
  const DType dtype = fp8 ? DType::F8E4M3 : params_[0]->weight.dtype();
  const Device device = params_[0]->weight.device();
  offsets_.assign(params_.size(), 0);
  int64_t total = 0;
  BufferBucket current;
  auto close_bucket = [&] {
    if (current.params.empty()) return;
    current.begin = buckets_.empty() ? 0 : buckets_.back().end;
    current.end = round_up(std::max(total, current.begin + 1), kAlign * num_shards);
    total = current.end;
    buckets_.push_back(std::move(current));
    current = BufferBucket();
  };
  // Reverse order: Megatron's _ParamAndGradBuffer iterates params[::-1].
  for (size_t k = params_.size(); k-- > 0;) {
    Param* p = params_[k];
    MEGATON_CHECK(p->fp8_param == fp8, "ParamAndGradBuffer: param '{}' is {}an FP8 weight, "
                  "the first is {}", p->name, p->fp8_param ? "" : "not ", fp8 ? "" : "not");
    MEGATON_CHECK((fp8 || p->weight.dtype() == dtype) && p->weight.device() == device,
                  "ParamAndGradBuffer: param '{}' is {} on {}, the first {} on {}", p->name,
                  dtype_name(p->weight.dtype()), device_name(p->weight.device()), dtype_name(dtype),
                  device_name(device));
    const bool alone = std::find(own_bucket.begin(), own_bucket.end(), p) != own_bucket.end();
    if (alone) close_bucket();
    offsets_[k] = total;
    total += round_up(p->weight.numel(), kAlign);
    current.params.push_back(p);
    const int64_t bucket_begin = buckets_.empty() ? 0 : buckets_.back().end;
    if (alone || (bucket_size > 0 && total - bucket_begin >= bucket_size)) close_bucket();
  }
  close_bucket();
  weights_ = Tensor::zeros({total}, dtype, device);
  grads_ = Tensor::zeros({total}, grad_dtype, device);
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (const Param* p : buckets_[b].params) bucket_index_[p] = int(b);
  for (size_t i = 0; i < params_.size(); ++i) {
    Param* p = params_[i];
    const bool main_is_weight = p->main_param.defined() && p->main_param.raw() == p->weight.raw();
    Tensor view = weights_.rows(offsets_[i], p->weight.numel()).view(p->weight.shape());
    if (fp8) {
      // The fp32 values stay in main_param (an fp32 run's weight was its main param).
      MEGATON_CHECK(p->main_param.defined(), "FP8 weight '{}' without an fp32 main param", p->name);
      p->weight = view;
    } else {
      view.copy_from(p->weight);
      p->weight = view;
      if (main_is_weight) p->main_param = view;
    }
    p->main_grad = grads_.rows(offsets_[i], p->weight.numel()).view(p->weight.shape());
  }
}

int ParamAndGradBuffer::bucket_of(const Param* p) const {
  auto it = bucket_index_.find(p);
  return it == bucket_index_.end() ? -1 : it->second;
}

std::vector<BufferPiece> ParamAndGradBuffer::shard_pieces(int64_t index) const {
  std::vector<BufferPiece> out;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const int64_t begin = shard_begin(b, index);
    for (const BufferPiece& piece : pieces(begin, begin + shard_numel(b))) out.push_back(piece);
  }
  return out;
}

std::vector<BufferPiece> ParamAndGradBuffer::pieces(int64_t begin, int64_t end) const {
  std::vector<BufferPiece> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t start = offsets_[i], stop = start + params_[i]->weight.numel();
    const int64_t lo = std::max(start, begin), hi = std::min(stop, end);
    if (lo < hi) out.push_back({params_[i], lo - start, lo, hi - lo});
  }
  std::sort(out.begin(), out.end(), [](const BufferPiece& a, const BufferPiece& b) {
    return a.buffer_offset < b.buffer_offset;
  });
  return out;
}

}  // namespace megaton
