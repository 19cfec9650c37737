// muon_apply on the GPU (ops/muon.h): EO OrthogonalizedOptimizer.step's tail, the decoupled
// weight decay then the scaled orthogonalised update, over a list of matrices in a few
// launches (muon_elementwise.cuh), the factors computed on the device from control[kAdamLr]
// exactly as the CPU reference (ops/cpu/muon_update.cpp) computes them.
#include <vector>

#include "ops/adam_precision_math.h"
#include "ops/cuda/muon.h"
#include "ops/cuda/muon_elementwise.cuh"

namespace megaton::ops::cuda {
namespace {

struct MuonApplyRule {
  struct Consts {
    float decay, step;
  };
  // decay = float(1 - lr wd) and step = float(lr scale), each in fp64.
  __device__ Consts consts(const float* control, float weight_decay, float scale) const {
    const float lr = control[kAdamLr];
    return {adam_precision_decay(lr, weight_decay), float(__dmul_rn(double(lr), double(scale)))};
  }
  __device__ void update(const Consts& c, float& main, float update, float*) const {
    main = __fmaf_rn(-c.step, update, __fmul_rn(main, c.decay));
  }
};

}  // namespace

void muon_apply(std::vector<Tensor>& mains, const std::vector<Tensor>& updates,
                std::vector<Tensor>& copies, const std::vector<float>& weight_decays,
                const std::vector<float>& scales, const Tensor& control) {
  launch_rule("muon_apply", MuonApplyRule{}, mains, updates, nullptr, copies, weight_decays,
              &scales, control);
}

}  // namespace megaton::ops::cuda
