// Per-sample totals of squared norms and clipping factors (CPU): the few (B,)-sized steps
// between the norms and the clipped sums, one pass each instead of a chain of tensor ops.
#pragma once
#include <cstdint>
#include <vector>

namespace fastdp {

// total[i] = sum over k of parts[k][i] (k in order), i < batch. Returns whether every total
// is finite (the parts are >= 0 or NaN, so a total is finite exactly when its parts are).
bool total_sq_norms(const std::vector<const double*>& parts, int64_t batch, double* total);

// out[i] = bound / (sqrt(total[i]) + offset / scale), then min(out[i], scale) if clamp: the
// clipping coefficient scale * min(1, bound / (scale sqrt(total[i]) + offset)) of gradients
// whose squared norms were divided by scale^2 (flat clipping: offset = EPS, clamp; automatic
// clipping: offset = gamma, no clamp).
void clip_factors(const double* total, int64_t batch, double bound, double scale, double offset, bool clamp,
                  double* out);

}  // namespace fastdp
