// Per-sample totals and clipping factors (see coefficients.h).
#include "coefficients.h"

#include <algorithm>
#include <cmath>

namespace fastdp {

bool total_sq_norms(const std::vector<const double*>& parts, int64_t batch, double* total) {
  std::fill(total, total + batch, 0.0);
  for (const double* part : parts)
    for (int64_t i = 0; i < batch; ++i) total[i] += part[i];
  bool finite = true;
  for (int64_t i = 0; i < batch; ++i) finite = finite && std::isfinite(total[i]);
  return finite;
}

void clip_factors(const double* total, int64_t batch, double bound, double scale, double offset, bool clamp,
                  double* out) {
  const double shift = offset / scale;
  for (int64_t i = 0; i < batch; ++i) {
    // max: a ghost norm of a sample whose gradient is ~0 can come out a rounding below 0 (NaN stays NaN)
    const double f = bound / (std::sqrt(std::max(total[i], 0.0)) + shift);
    out[i] = clamp ? std::min(f, scale) : f;
  }
}

}  // namespace fastdp
