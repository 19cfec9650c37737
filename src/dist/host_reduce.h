// Sums of host fp64 values over a group, bit-identical on every member.
#pragma once
#include <vector>

#include "dist/comm.h"

namespace megaton::dist {

// values[i] summed over the members of g, in member order, in fp64: every member gets
// the same bits (the doubles travel as their bit patterns through an all_gather on the
// Comm's device). A group of one returns values unchanged. Collective over g.
std::vector<double> sum_over(Comm& comm, const Group& g, const std::vector<double>& values);

}  // namespace megaton::dist
