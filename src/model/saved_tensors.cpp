// Visitors over the layers' saved-state structs (the members of each Saved, in order).
#include "model/saved_tensors.h"

namespace megaton {

void for_each_tensor(Fp8Tensor& t, const SavedTensorVisitor& fn) {
  for (Tensor* slot : {&t.data, &t.scale_inv, &t.data_t, &t.scale_inv_t, &t.scale}) fn(*slot);
}

void for_each_tensor(Fp8LinearGemms::Saved& s, const SavedTensorVisitor& fn) {
  for_each_tensor(s.x, fn);
  for_each_tensor(s.w, fn);
}

void for_each_tensor(Fp8GroupedLinearGemms::Saved& s, const SavedTensorVisitor& fn) {
  for (Fp8LinearGemms::Saved& group : s.groups) for_each_tensor(group, fn);
}

void for_each_tensor(Linear::Saved& s, const SavedTensorVisitor& fn) {
  fn(s.x);
  for_each_tensor(s.fp8, fn);
}

void for_each_tensor(Norm::Saved& s, const SavedTensorVisitor& fn) {
  for (Tensor* slot : {&s.x, &s.mean, &s.rstd}) fn(*slot);
}

void for_each_tensor(MLP::Activations& s, const SavedTensorVisitor& fn) {
  fn(s.mlp.fc1_out);
  fn(s.mlp.x);
  for_each_tensor(s.linear_fc1, fn);
  for_each_tensor(s.linear_fc2, fn);
}

void for_each_tensor(ops::QkNormSaved& s, const SavedTensorVisitor& fn) {
  for (Tensor* slot : {&s.q_input, &s.k_input, &s.q_mean, &s.q_rstd, &s.k_mean, &s.k_rstd})
    fn(*slot);
}

void for_each_tensor(SelfAttention::Activations& s, const SavedTensorVisitor& fn) {
  SelfAttention::Saved& a = s.attention;
  for (Tensor* slot : {&a.q, &a.k, &a.v, &a.out, &a.lse}) fn(*slot);
  for_each_tensor(a.qk_norm, fn);
  for_each_tensor(s.linear_qkv, fn);
  for_each_tensor(s.linear_proj, fn);
}

void for_each_tensor(TopKRouter::Saved& s, const SavedTensorVisitor& fn) {
  for (Tensor* slot : {&s.x, &s.jitter, &s.logits, &s.probs, &s.indices, &s.keep, &s.lse})
    fn(*slot);
  for (TopKRouter::AuxTerm& term : s.aux) {
    fn(term.coeffs);
    fn(term.scores);
  }
}

void for_each_tensor(SharedExpertMLP::Activations& s, const SavedTensorVisitor& fn) {
  for (Tensor* slot : {&s.gate.x, &s.gate.mlp_out, &s.gate.logits}) fn(*slot);
  for_each_tensor(s.mlp, fn);
}

}  // namespace megaton
