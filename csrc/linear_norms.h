// Per-sample squared norms of a linear layer's weight gradient (CPU), tiled so that neither
// the T x T Gram matrices nor the (p, d) per-sample gradients are ever stored; and of a 2-D
// convolution's, which is a linear layer on the input's patches.
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
// Extra memory: per thread one tile and two (64 x 16) panels; B * ceil(p / 64) * ceil(d / 64)
// partial sums.
template <typename F>
void linear_sq_norms_direct(const Strided3<F>& a, const Strided3<F>& g, double* out);

// A zero-padded 2-D convolution (1-D as height 1): input x (B, C, H, W) and output gradient
// g (B, C_out, OH, OW), both C-contiguous; C and C_out divisible by groups.
struct Conv2dGeometry {
  int64_t batch, channels, height, width;
  int64_t out_channels, out_height, out_width;
  int64_t groups, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
};

// out[i] = squared norm of sample i's weight gradient, summed over groups. Per (sample, group)
// the zero-padded input is split by stride phase into per-thread scratch (never the whole
// batch's), from which every patch row is a contiguous run; the ghost route (Gram tiles)
// copies the rows into a (d x T) patch matrix, d = C / groups * kernel area, T = OH * OW
// (about), the direct route (tiles of g_i^T a_i) reads them in place. The direct route also writes each
// sample's weight gradient to `grads` unless it is null, each group's transposed: (B, groups,
// C_in / groups * KH * KW, C_out / groups), so that the kernel's tiles are stored as whole vectors.
// Either route also writes each sample's bias gradient (the sum of g over positions, in
// float64, then rounded), (B, C_out), to `bias_grads` unless it is null. Unless `grad_input` is
// null, it also writes the input gradient (B, C, H, W) there, from `weight` (C_out, C / groups,
// KH, KW), C-contiguous: per (sample, group) the patch-row gradients W^T g_i, summed back into
// the stride-phase images of dx and un-phased (a transposed convolution, from the g already read).
template <typename F>
void conv2d_sq_norms(const F* x, const F* g, const Conv2dGeometry& geometry, bool ghost, double* out, F* grads,
                     F* bias_grads, const F* weight, F* grad_input);

}  // namespace fastdp
