// Visitors over the tensors a layer's forward saves for its backward (activation offloading).
#pragma once
#include <functional>

#include "model/attention.h"
#include "model/layers.h"
#include "model/router.h"
#include "model/shared_experts.h"

namespace megaton {

// Called on each tensor slot of a saved-state struct, defined or not, in a fixed order for
// a given forward (the order of the struct's members, vectors element by element), so a
// caller can take tensors out (assign Tensor()) and put them back slot by slot. Only the
// state backward reads: what a struct keeps for other readers is left out (see
// MoELayer::for_each_saved_tensor). A slot left out is never moved, which is always safe.
using SavedTensorVisitor = std::function<void(Tensor&)>;

void for_each_tensor(Fp8Tensor& t, const SavedTensorVisitor& fn);
void for_each_tensor(Fp8LinearGemms::Saved& s, const SavedTensorVisitor& fn);
void for_each_tensor(Fp8GroupedLinearGemms::Saved& s, const SavedTensorVisitor& fn);
void for_each_tensor(Linear::Saved& s, const SavedTensorVisitor& fn);
void for_each_tensor(Norm::Saved& s, const SavedTensorVisitor& fn);
void for_each_tensor(MLP::Activations& s, const SavedTensorVisitor& fn);
void for_each_tensor(ops::QkNormSaved& s, const SavedTensorVisitor& fn);
void for_each_tensor(SelfAttention::Activations& s, const SavedTensorVisitor& fn);
void for_each_tensor(TopKRouter::Saved& s, const SavedTensorVisitor& fn);
void for_each_tensor(SharedExpertMLP::Activations& s, const SavedTensorVisitor& fn);

}  // namespace megaton
