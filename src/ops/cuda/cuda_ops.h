// CUDA implementations of the op catalogue (src/ops/ops.h), one .cu file per family.
//
// Same signatures and semantics as ops.h; reached through ops.h when the tensors live on
// the GPU (MEGATON_CUDA_DISPATCH in each CPU door function). Float activations and
// weights may be BF16 (--bf16), F16 (--fp16) or F32, with the same fp32 arithmetic;
// statistics (lse, rstd, mean, probs, losses) are F32, and gradients of parameters
// accumulate into F32 main_grad tensors. The FP8 ops take F32 or BF16 only. Built only
// with CUDA.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace megaton::ops {
// Router option types, defined in ops/ops.h.
enum class RouterScoreFunction;
struct RouterTopK;
// The FP8 scale rule, defined in ops/fp8.h.
struct Fp8ScaleRule;
// The fused q/k norm's parameters, saved tensors and gradients, defined in ops/ops.h.
struct QkNorm;
struct QkNormSaved;
struct QkNormGrads;
}  // namespace megaton::ops

namespace megaton::ops::cuda {

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
          float alpha, float beta);
void gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& bias,
               Tensor& c);
void grouped_gemm(const Tensor& a, const std::vector<Tensor>& b, bool trans_b, Tensor& c,
                  const std::vector<int64_t>& group_rows, float beta);
void grouped_gemm_wgrad(const Tensor& a, const Tensor& b, std::vector<Tensor>& c,
                        const std::vector<int64_t>& group_rows, float beta);
void grouped_gemm(const Tensor& a, const std::vector<Tensor>& b, bool trans_b, Tensor& c,
                  const Tensor& group_rows, float beta);
void grouped_gemm_wgrad(const Tensor& a, const Tensor& b, std::vector<Tensor>& c,
                        const Tensor& group_rows);
void cast(const Tensor& src, Tensor& dst);
void add_(Tensor& y, const Tensor& x, float alpha);
void scale_(Tensor& x, float s);
void bias_add_(Tensor& y, const Tensor& bias);
void bias_backward(const Tensor& dy, Tensor& dbias);
void weighted_bias_add_(Tensor& y, const Tensor& bias, const Tensor& weights);
void weighted_bias_backward(const Tensor& dy, const Tensor& bias, const Tensor& weights,
                            Tensor& dbias, Tensor* dweights);
double sum_of_squares(const Tensor& x);
double sum(const Tensor& x);
void dot(const Tensor& a, const Tensor& b, Tensor& out);
void sum(const Tensor& x, Tensor& out);
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable);
void rmsnorm_forward(const Tensor& x, const Tensor& weight, float eps, Tensor& y, Tensor& rstd);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                      const Tensor& rstd, Tensor& dx, Tensor& dweight, const Tensor& dresidual);
void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                       Tensor& y, Tensor& mean, Tensor& rstd);
void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                        const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dweight,
                        Tensor& dbias, const Tensor& dresidual);
void add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& weight,
                         float eps, Tensor& sum, Tensor& y, Tensor& rstd);
void add_layernorm_forward(const Tensor& x, const Tensor& residual, const Tensor& weight,
                           const Tensor& bias, float eps, Tensor& sum, Tensor& y, Tensor& mean,
                           Tensor& rstd);
void swiglu_forward(const Tensor& x, Tensor& y);
void swiglu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* y);
void gelu_forward(const Tensor& x, Tensor& y);
void gelu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* y);
void squared_relu_forward(const Tensor& x, Tensor& y);
void squared_relu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* y);
void weighted_swiglu_forward(const Tensor& x, const Tensor& weights, Tensor& y);
void weighted_swiglu_backward(const Tensor& dy, const Tensor& x, const Tensor& weights,
                              Tensor& dx, Tensor& dweights, Tensor* y);
void weighted_gelu_forward(const Tensor& x, const Tensor& weights, Tensor& y);
void weighted_gelu_backward(const Tensor& dy, const Tensor& x, const Tensor& weights,
                            Tensor& dx, Tensor& dweights, Tensor* y);
void weighted_squared_relu_forward(const Tensor& x, const Tensor& weights, Tensor& y);
void weighted_squared_relu_backward(const Tensor& dy, const Tensor& x, const Tensor& weights,
                                    Tensor& dx, Tensor& dweights, Tensor* y);
void sigmoid_gate_forward(const Tensor& x, const Tensor& logits, Tensor& y);
void sigmoid_gate_backward(const Tensor& dy, const Tensor& x, const Tensor& logits, Tensor& dx,
                           Tensor& dlogits);
void dropout_forward(const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t stream);
void dropout_backward(const Tensor& dy, Tensor& dx, float p, uint64_t seed, uint64_t stream);
void bias_dropout_add(const Tensor& x, const Tensor& bias, const Tensor& residual, Tensor& out,
                      float p, uint64_t seed, uint64_t stream);
// rotary_dim (the RoPE ops): the channels rotated, 0 = the whole head (ops.h).
void rope_forward(const Tensor& x, Tensor& y, float base, int64_t position_offset,
                  int64_t rotary_dim);
void rope_backward(const Tensor& dy, Tensor& dx, float base, int64_t position_offset,
                   int64_t rotary_dim);
void qkv_split_rope(const Tensor& qkv, int64_t batch, int64_t num_query_groups, Tensor& q,
                    Tensor& k, Tensor& v, bool apply_rope, float rotary_base,
                    const Tensor& position_ids, int64_t rotary_dim);
void qkv_pack_rope_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                            int64_t num_query_groups, bool apply_rope, float rotary_base,
                            Tensor& dqkv, const Tensor& position_ids, int64_t rotary_dim);
void qkv_split_norm_rope(const Tensor& qkv, int64_t batch, int64_t num_query_groups,
                         const QkNorm& norm, bool apply_rope, float rotary_base, Tensor& q,
                         Tensor& k, Tensor& v, QkNormSaved& saved, const Tensor& position_ids,
                         int64_t rotary_dim);
void qkv_pack_norm_rope_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                 const QkNormSaved& saved, int64_t num_query_groups,
                                 const QkNorm& norm, bool apply_rope, float rotary_base,
                                 Tensor& dqkv, QkNormGrads& grads, const Tensor& position_ids,
                                 int64_t rotary_dim);
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                       Tensor& lse, float dropout_p, uint64_t seed, uint64_t stream,
                       float softmax_scale);
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk,
                        Tensor& dv, float dropout_p, uint64_t seed, uint64_t stream,
                        float softmax_scale);
// Single-query attention over a KV cache, inference only (attention_kv_cache.cu).
void attention_kv_cache(const Tensor& q, const Tensor& key_cache, const Tensor& value_cache,
                        int64_t first_position, Tensor& out, float softmax_scale);
void cross_entropy_forward(const Tensor& logits, const Tensor& labels, Tensor& losses,
                           Tensor& lse);
void cross_entropy_backward(const Tensor& dlosses, const Tensor& logits, const Tensor& labels,
                            const Tensor& lse, Tensor& dlogits);
// Vocab-parallel embedding and cross entropy (vocab_parallel.cu).
void embedding_forward_vocab_range(const Tensor& ids, const Tensor& table, int64_t vocab_start,
                                   Tensor& out);
void embedding_backward_vocab_range(const Tensor& dout, const Tensor& ids, int64_t vocab_start,
                                    Tensor& dtable);
void cross_entropy_partial_stats(const Tensor& logits, const Tensor& labels,
                                 int64_t vocab_start, Tensor& row_max, Tensor& sum_exp,
                                 Tensor& target_logit);
void cross_entropy_rescale_sum_exp(const Tensor& row_max, const Tensor& global_max,
                                   Tensor& sum_exp);
void cross_entropy_finish(const Tensor& global_max, const Tensor& sum_exp,
                          const Tensor& target_logit, Tensor& losses, Tensor& lse);
void cross_entropy_backward_vocab_range(const Tensor& dlosses, const Tensor& logits,
                                        const Tensor& labels, const Tensor& lse,
                                        int64_t vocab_start, Tensor& dlogits);
// MoE router with all of Megatron's options (moe_router.cu, moe_router_stats.cu,
// moe_router_sinkhorn.cu).
void moe_router_topk_forward(const Tensor& logits, const Tensor& expert_bias,
                             const RouterTopK& options, Tensor& probs, Tensor& indices);
void moe_router_topk_backward(const Tensor& dprobs, const Tensor& logits, const Tensor& probs,
                              const Tensor& indices, const RouterTopK& options, Tensor& dlogits);
void moe_sinkhorn(const Tensor& logits, Tensor& out);
void moe_aux_loss_statistics(const Tensor& logits, RouterScoreFunction score_function, int topk,
                             int64_t first_row, int64_t rows_per_group, Tensor& scores,
                             Tensor& score_sums, Tensor& counts);
void moe_aux_loss_statistics_backward(const Tensor& coeffs, const Tensor& logits,
                                      const Tensor& scores, RouterScoreFunction score_function,
                                      int64_t first_row, int64_t rows_per_group, Tensor& dlogits);
void moe_router_logsumexp(const Tensor& logits, Tensor& lse);
void moe_z_loss_backward(float scale, const Tensor& logits, const Tensor& lse, Tensor& dlogits);
void moe_tokens_per_expert(const Tensor& indices, int64_t num_experts, Tensor& counts);
void moe_expert_bias_update(const Tensor& counts, float rate, Tensor& bias);
// Token dropping by expert capacity (moe_router_capacity.cu).
void moe_capacity_drop(const Tensor& probs, const Tensor& indices, int64_t num_experts,
                       int64_t capacity, bool by_position, Tensor& keep, Tensor& kept_counts);
void moe_mark_dropped(const Tensor& indices, const Tensor& keep, int64_t num_experts,
                      Tensor& routed);
void fill_normal(Tensor& t, uint64_t seed, uint64_t stream);
void fill_uniform(Tensor& t, float lo, float hi, uint64_t seed, uint64_t stream);
void mul_(Tensor& y, const Tensor& x);
void moe_permute_rows(const Tensor& x, const Tensor& row_id_map, int k, Tensor& permuted);
void moe_permute(const Tensor& x, const Tensor& indices, int num_experts, Tensor& permuted,
                 Tensor& row_id_map, Tensor& tokens_per_expert);
void moe_permute_backward(const Tensor& dpermuted, const Tensor& row_id_map, int k, Tensor& dx);
void moe_unpermute(const Tensor& expert_out, const Tensor& row_id_map, const Tensor& probs,
                   Tensor& out);
void moe_unpermute_backward(const Tensor& dout, const Tensor& expert_out,
                            const Tensor& row_id_map, const Tensor& probs,
                            Tensor& dexpert_out, Tensor& dprobs);
void moe_pad_rows(const Tensor& rows, const std::vector<int64_t>& group_rows,
                  const std::vector<int64_t>& padded_rows, Tensor& padded);
void moe_unpad_rows(const Tensor& padded, const std::vector<int64_t>& group_rows,
                    const std::vector<int64_t>& padded_rows, Tensor& rows);
// moe_sort_chunks with its arguments checked: output chunk j is rows[j] rows of src from
// row src_first[j] (copy_chunks.cu).
void moe_sort_chunks(const Tensor& src, const std::vector<int64_t>& src_first,
                     const std::vector<int64_t>& rows, Tensor& dst);
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step);
// Multi-tensor ops (multi_tensor.cu): batches of up to 64 (adamw) or 160 tensors per
// launch, their pointers and sizes passed by value as a __grid_constant__ kernel
// parameter; each block updates or reduces one chunk of one tensor. sum_of_squares writes
// one fp64 partial per block, sums them in a fixed order in a second kernel and makes the
// call's only host synchronization; count_zeros adds each block's integer count into one
// counter (exact in any order) and synchronizes once; scale_ and adamw do not synchronize.
double multi_tensor_sum_of_squares(const std::vector<Tensor>& tensors);
int64_t multi_tensor_count_zeros(const std::vector<Tensor>& tensors);
void multi_tensor_scale_(std::vector<Tensor>& tensors, float scale);
void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float lr, float beta1, float beta2, float eps, int64_t step,
                        float grad_scale);
void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float beta1, float beta2, float eps, const Tensor& control);
void multi_tensor_sum_of_squares(const std::vector<Tensor>& tensors, Tensor& out);
void adamw_step_control(const Tensor& sum_sq_parts, double norm_scale, double max_norm,
                        float grad_scale_factor, const Tensor& loss, bool check_nan,
                        const Tensor& lr, float beta1, float beta2, Tensor& state,
                        Tensor& control, Tensor& grad_norm_out);
// FP8 (ops/fp8.h). Quantization (fp8.cu) equals the CPU reference bit for bit: one
// fused kernel reads x once and writes out, out_t and amax (per tensor), or out, out_t and
// both scale_inv tensors (blockwise, 128 x 128 tiles of 256 threads); scale updates are
// single-block kernels that never synchronize with the host. fp8_gemm (fp8_gemm.cpp) is
// cuBLASLt with split accumulation (fast accumulation on request, per-tensor only), per-tensor
// or 1x128 / 128x128 block scales.
void fp8_amax(const Tensor& x, Tensor& amax);
void fp8_update_scale(const Tensor& amax, const Fp8ScaleRule& rule, Tensor& scale,
                      Tensor& scale_inv);
void fp8_delayed_scaling_update(Tensor& amax_history, const Fp8ScaleRule& rule, bool max_algo,
                                Tensor& scale, Tensor& scale_inv);
void fp8_quantize(const Tensor& x, const Tensor& scale, Tensor& out, Tensor& out_t, Tensor& amax);
void fp8_quantize_blockwise(const Tensor& x, int64_t block_rows, const Fp8ScaleRule& rule,
                            Tensor& out, Tensor& scale_inv, Tensor& out_t, Tensor& scale_inv_t);
void fp8_dequantize(const Tensor& q, const Tensor& scale_inv, Tensor& x);
// fp8_transpose.cu: a byte transpose through 64 x 64 shared-memory tiles.
void fp8_transpose(const Tensor& q, Tensor& q_t);
void fp8_gemm(const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
              const Tensor& b_scale_inv, Tensor& c, float alpha, float beta, bool fast_accumulation);
// fp8_multi.cu: the multi-tensor FP8 ops (ops/fp8.h), one launch each for all entries.
void fp8_amax_multi(const std::vector<Tensor>& x, const std::vector<Tensor>& amax);
void fp8_update_scale_multi(const std::vector<Tensor>& amax, const Fp8ScaleRule& rule,
                            const std::vector<Tensor>& scale, const std::vector<Tensor>& scale_inv);
void fp8_delayed_scaling_update_multi(const std::vector<Tensor>& amax_history,
                                      const Fp8ScaleRule& rule, bool max_algo,
                                      const std::vector<Tensor>& scale,
                                      const std::vector<Tensor>& scale_inv);
void fp8_quantize_multi(const std::vector<Tensor>& x, const std::vector<Tensor>& scale,
                        const std::vector<Tensor>& out, const std::vector<Tensor>& out_t,
                        const std::vector<Tensor>& amax);
// grouped_gemm_fp8.cu: the FP8 grouped GEMM (ops/fp8.h) as one CUTLASS Hopper grouped
// GEMM; the door checks are done by the caller (ops/cpu/fp8_grouped.cpp).
void fp8_grouped_gemm(const std::vector<Tensor>& a, const std::vector<Tensor>& a_scale_inv,
                      const std::vector<Tensor>& b, const std::vector<Tensor>& b_scale_inv,
                      const std::vector<Tensor>& c, float alpha, float beta,
                      bool fast_accumulation);

}  // namespace megaton::ops::cuda
