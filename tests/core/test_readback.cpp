// Readback on the CPU: the values are taken when it is made, later writes do not show.
#include <gtest/gtest.h>

#include "core/readback.h"

namespace megaton {
namespace {

TEST(Readback, HostTensorsAreTakenAtConstruction) {
  Tensor a = Tensor::from({2}, {3.0f, 4.0f});
  Readback read({a});
  a.f32()[0] = 7.0f;
  read.wait();
  EXPECT_EQ(read.tensor(0).f32()[0], 3.0f);
  EXPECT_EQ(read.tensor(0).f32()[1], 4.0f);
  EXPECT_THROW(read.tensor(1), InternalError);
}

}  // namespace
}  // namespace megaton
