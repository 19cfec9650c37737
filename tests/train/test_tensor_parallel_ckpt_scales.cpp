// The checkpoint entries of per-parameter scales (fp16/fp8 moments' ".exp_avg.scale",
// fp16 main params' ".main_param.scale"): assemble_tensor_parallel knows whose they are and
// keeps them whole (one per parameter), while param_of_entry leaves them unsliced on load.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "model/param.h"
#include "model/parallel.h"
#include "train/tensor_parallel_ckpt.h"

namespace megaton {
namespace {

TEST(TensorParallelCkptScales, ScaleEntriesBelongToTheirParamAndStayWhole) {
  Param p;
  p.name = "decoder.layers.0.mlp.linear_fc1.weight";
  p.tp_split_dim = 0;
  const std::map<std::string, const Param*> params = {{p.name, &p}};
  dist::NamedTensors entries;
  entries.emplace_back("model." + p.name, Tensor::from({2, 2}, {1, 2, 3, 4}));
  for (const char* suffix : {".exp_avg.scale", ".exp_avg_sq.scale", ".main_param.scale"})
    entries.emplace_back("optimizer." + p.name + suffix, Tensor::from({1}, {0.25f}));
  const dist::NamedTensors out = assemble_tensor_parallel(entries, params, ModelParallel{});
  ASSERT_EQ(out.size(), entries.size());
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].first, entries[i].first);
    EXPECT_EQ(out[i].second.numel(), entries[i].second.numel());
  }
  // On load the scales are taken as they are (no param: not sliced).
  EXPECT_EQ(param_of_entry("optimizer." + p.name + ".main_param.scale", params), nullptr);
  EXPECT_EQ(param_of_entry("optimizer." + p.name + ".exp_avg", params), &p);
  // An entry of no parameter is an internal error.
  dist::NamedTensors stray;
  stray.emplace_back("optimizer.nothing.main_param.scale", Tensor::from({1}, {1.0f}));
  EXPECT_ANY_THROW(assemble_tensor_parallel(stray, params, ModelParallel{}));
}

}  // namespace
}  // namespace megaton
