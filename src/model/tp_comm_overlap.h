// Tensor-parallel communication hidden behind the GEMMs of sequence-parallel linears
// (--tp-comm-overlap; the idea of Transformer Engine's userbuffers overlap, on the
// asynchronous NCCL collectives of dist::Comm). Each function gives the values of its
// unoverlapped form (gather, then GEMM; GEMM, then reduce-scatter): only the order of the
// work and the row blocks each GEMM call sees change.
#pragma once
#include <functional>

#include "core/tensor.h"
#include "model/parallel.h"

namespace megaton {

// A GEMM over a block of rows: writes `out_rows` (rows of the output) from `in_rows` (the
// same rows of the input), e.g. out_rows = in_rows W^T.
using RowGemm = std::function<void(const Tensor& in_rows, Tensor out_rows)>;

// out [T, N] = gemm(x_full), x_full [T, K] being the sequence-parallel all-gather of this
// rank's x [T/tp, K] (tp = mp.tp_size(), rank r). The all-gather into x_full (allocated
// by the caller, [T, K], x's dtype) starts first; meanwhile this rank's own block of out,
// rows [r T/tp, (r+1) T/tp), is computed from x; after the wait, the blocks before and
// after it. x_full is whole on return (for the weight gradient). tp == 1: gemm(x, out).
void gemm_all_gathered_rows(const Tensor& x, Tensor& x_full, Tensor& out, const RowGemm& gemm,
                            const ModelParallel& mp);

// The sequence-parallel reduce-scatter of y = gemm(x) ([T, N], a partial sum on each rank)
// -> [T/tp, N] (the sum over ranks of block r), pipelined with the GEMM: the rows go in
// `splits` chunks, chunk c being sub-block c (T/(tp splits) rows) of every rank's block;
// each chunk's reduce-scatter starts when its GEMMs are done and runs beside the next
// chunk's. y has x's dtype. splits is lowered until T divides by tp x splits (at least 1).
// Every output row is the sum of the same rows as in one reduce-scatter of y.
Tensor gemm_reduce_scattered_rows(const Tensor& x, int64_t n, const RowGemm& gemm,
                                  const ModelParallel& mp, int splits);

// The chunks gemm_reduce_scattered_rows uses under --tp-comm-overlap:
// MEGATON_TP_COMM_OVERLAP_SPLITS if set (an integer from 1 to 64; megaton::Error otherwise),
// else 2. Read on the first call.
int tp_comm_overlap_splits();

}  // namespace megaton
