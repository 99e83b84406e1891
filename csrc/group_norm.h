// GroupNorm backward that also returns each sample's parameter gradients (CPU).
#pragma once
#include <cstdint>

namespace fastdp {

// x, dy: (N, C, HW) C-contiguous; mean, rstd: (N, G) from the forward; gamma: (C) or null
// (treated as ones); C divisible by G. Per sample n and channel c it writes
//   dbeta[n, c]  = sum_s dy,   dgamma[n, c] = rstd (sum_s dy x - mean sum_s dy),
// and, unless dx is null, the input gradient dx (N, C, HW). One pass per (sample, group)
// reads that group's x and dy for the sums and again, from cache, for dx.
template <typename F>
void group_norm_backward(const F* x, const F* dy, const F* mean, const F* rstd, const F* gamma, int64_t batch,
                         int64_t channels, int64_t hw, int64_t groups, F* dx, F* dgamma, F* dbeta);

}  // namespace fastdp
