// GroupNorm backward with per-sample parameter gradients (see group_norm.h).
//
// With x_hat = (x - mean) rstd and h = gamma dy, the input gradient of one group of D
// elements is dx = rstd (h - mean(h) - x_hat mean(h x_hat)); in terms of the per-channel
// sums ds_c = sum dy (x - mean) and db_c = sum dy that the parameter gradients need anyway
// (dgamma_c = rstd ds_c, dbeta_c = db_c):
//   dx = rstd gamma_c dy + b (x - mean) + k,  b = -rstd^3 sum_c gamma_c ds_c / D,  k = -rstd sum_c gamma_c db_c / D.
// x enters centred: with sums of dy x and a term b x the large parts cancelled in float32
// where the mean is large against the spread (a group of values near 1000: 2 % errors).
#include "group_norm.h"

#include <algorithm>

#include "simd.h"  // FASTDP_MULTIVERSION

namespace fastdp {
namespace {

constexpr int64_t kChunk = 4096;  // elements summed in the input dtype before adding in float64

template <typename F>
inline void group_item(const F* x, const F* dy, F mean, F rstd, const F* gamma, int64_t channels, int64_t hw,
                       F* dx, F* dgamma, F* dbeta) {
  double gamma_ds = 0.0, gamma_db = 0.0;
  for (int64_t c = 0; c < channels; ++c) {
    const F* xc = x + c * hw;
    const F* dyc = dy + c * hw;
    double ds = 0.0, db = 0.0;
    for (int64_t s0 = 0; s0 < hw; s0 += kChunk) {
      const int64_t s1 = std::min(hw, s0 + kChunk);
      F ds_part = 0, db_part = 0;
#pragma omp simd reduction(+ : ds_part, db_part)
      for (int64_t s = s0; s < s1; ++s) {
        ds_part += dyc[s] * (xc[s] - mean);
        db_part += dyc[s];
      }
      ds += ds_part;
      db += db_part;
    }
    dgamma[c] = static_cast<F>(rstd * ds);
    dbeta[c] = static_cast<F>(db);
    const double gc = gamma ? gamma[c] : 1.0;
    gamma_ds += gc * ds;
    gamma_db += gc * db;
  }
  if (!dx) return;
  const double n = static_cast<double>(channels * hw), r = rstd;
  const F b = static_cast<F>(-gamma_ds * r * r * r / n), k = static_cast<F>(-r * gamma_db / n);
  for (int64_t c = 0; c < channels; ++c) {
    const F a = static_cast<F>(r * (gamma ? gamma[c] : 1.0));
    const F* xc = x + c * hw;
    const F* dyc = dy + c * hw;
    F* dxc = dx + c * hw;
#pragma omp simd
    for (int64_t s = 0; s < hw; ++s) dxc[s] = a * dyc[s] + b * (xc[s] - mean) + k;
  }
}

FASTDP_MULTIVERSION void group_item_isa(const float* x, const float* dy, float mean, float rstd, const float* gamma,
                                        int64_t channels, int64_t hw, float* dx, float* dgamma, float* dbeta) {
  group_item(x, dy, mean, rstd, gamma, channels, hw, dx, dgamma, dbeta);
}

FASTDP_MULTIVERSION void group_item_isa(const double* x, const double* dy, double mean, double rstd,
                                        const double* gamma, int64_t channels, int64_t hw, double* dx,
                                        double* dgamma, double* dbeta) {
  group_item(x, dy, mean, rstd, gamma, channels, hw, dx, dgamma, dbeta);
}

}  // namespace

template <typename F>
void group_norm_backward(const F* x, const F* dy, const F* mean, const F* rstd, const F* gamma, int64_t batch,
                         int64_t channels, int64_t hw, int64_t groups, F* dx, F* dgamma, F* dbeta) {
  const int64_t per_group = channels / groups;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < batch * groups; ++item) {
    const int64_t first = item * per_group;  // (sample, first channel of the group) as n * C + c
    const int64_t offset = first * hw;
    group_item_isa(x + offset, dy + offset, mean[item], rstd[item], gamma ? gamma + (item % groups) * per_group : nullptr,
                   per_group, hw, dx ? dx + offset : nullptr, dgamma + first, dbeta + first);
  }
}

template void group_norm_backward<float>(const float*, const float*, const float*, const float*, const float*, int64_t,
                                         int64_t, int64_t, int64_t, float*, float*, float*);
template void group_norm_backward<double>(const double*, const double*, const double*, const double*, const double*,
                                          int64_t, int64_t, int64_t, int64_t, double*, double*, double*);

}  // namespace fastdp
