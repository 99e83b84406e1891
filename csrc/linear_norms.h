// Per-sample squared norms of a linear layer's weight gradient (CPU), tiled so that neither
// the T x T Gram matrices nor the (p, d) per-sample gradients are ever stored.
#pragma once
#include <cstdint>

namespace fastdp {

// A strided (B, T, K) array: element [i, t, k] is data[i * sb + t * st + k * sk] (strides in elements).
template <typename F>
struct Strided3 {
  const F* data;
  int64_t batch, seq, dim;
  int64_t sb, st, sk;
};

// a: (B, T, d) activations, g: (B, T, p) output gradients (same B and T); out: (B,) float64.
// out[i] = ||g_i^T a_i||_F^2, computed as sum_{s,t} (a_s . a_t)(g_s . g_t) over the upper
// triangle of Gram tiles (off-diagonal counted twice). Extra memory: per thread packed
// (64 x d) and (64 x p) panels and two 64 x 64 Gram tiles; B * ceil(T / 64) partial sums.
template <typename F>
void linear_sq_norms_ghost(const Strided3<F>& a, const Strided3<F>& g, double* out);

// Same result from 64 x 64 tiles of g_i^T a_i accumulated over T and square-summed at once.
// Extra memory: per thread one tile and a (64 x 16) panel; B * ceil(p / 64) * ceil(d / 64)
// partial sums.
template <typename F>
void linear_sq_norms_direct(const Strided3<F>& a, const Strided3<F>& g, double* out);

}  // namespace fastdp
