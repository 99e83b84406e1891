// Squared L2 norm of every row of a matrix, accumulated in float64 (CPU).
#pragma once
#include <cstdint>

namespace fastdp {

// x: (rows, cols) C-contiguous; out[i] = sum_k x[i, k]^2 in float64 (each product formed
// in float64, so float32 inputs lose nothing to the accumulation). Long rows are split
// into chunks whose partial sums are added in a fixed order: the result does not depend
// on the number of threads.
template <typename F>
void rows_sq_norms(const F* x, int64_t rows, int64_t cols, double* out);

// A linear layer with one row per sample, a: (B, d), g: (B, p) C-contiguous: the squared
// norms of its per-sample weight gradients g_i a_i^T, weight[i] = |a_i|^2 |g_i|^2, and of its
// bias gradients g_i, bias[i] = |g_i|^2 (float64, as rows_sq_norms).
template <typename F>
void outer_sq_norms(const F* a, const F* g, int64_t batch, int64_t d, int64_t p, double* weight, double* bias);

}  // namespace fastdp
