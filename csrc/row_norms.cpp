// Row-wise squared norms (see row_norms.h): the per-sample norm of a per-sample tensor
// (B, ...) in one pass, instead of square, sum and cast as separate tensor operations.
#include "row_norms.h"

#include <algorithm>
#include <vector>

#include "simd.h"  // FASTDP_MULTIVERSION

namespace fastdp {
namespace {

constexpr int64_t kChunk = 1 << 16;          // elements of one work item (a row or a part of one)
constexpr int64_t kParallelMin = 1 << 15;    // below this many elements one thread does it all

template <typename F>
inline double sum_squares(const F* x, int64_t n) {
  double s = 0.0;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < n; ++k) s += static_cast<double>(x[k]) * static_cast<double>(x[k]);
  return s;
}

FASTDP_MULTIVERSION double sum_squares_isa(const float* x, int64_t n) { return sum_squares(x, n); }
FASTDP_MULTIVERSION double sum_squares_isa(const double* x, int64_t n) { return sum_squares(x, n); }

}  // namespace

template <typename F>
void rows_sq_norms(const F* x, int64_t rows, int64_t cols, double* out) {
  const int64_t chunks = std::max<int64_t>(1, (cols + kChunk - 1) / kChunk);  // per row
  std::vector<double> partial(static_cast<size_t>(rows * chunks));
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t item = 0; item < rows * chunks; ++item) {
    const int64_t row = item / chunks, start = (item % chunks) * kChunk;
    partial[item] = sum_squares_isa(x + row * cols + start, std::min(kChunk, cols - start));
  }
  for (int64_t row = 0; row < rows; ++row) {
    double s = 0.0;
    for (int64_t c = 0; c < chunks; ++c) s += partial[row * chunks + c];
    out[row] = s;
  }
}

template <typename F>
void outer_sq_norms(const F* a, const F* g, int64_t batch, int64_t d, int64_t p, double* weight, double* bias) {
  rows_sq_norms(a, batch, d, weight);
  rows_sq_norms(g, batch, p, bias);
  for (int64_t i = 0; i < batch; ++i) weight[i] *= bias[i];
}

template void outer_sq_norms<float>(const float*, const float*, int64_t, int64_t, int64_t, double*, double*);
template void outer_sq_norms<double>(const double*, const double*, int64_t, int64_t, int64_t, double*, double*);
template void rows_sq_norms<float>(const float*, int64_t, int64_t, double*);
template void rows_sq_norms<double>(const double*, int64_t, int64_t, double*);

}  // namespace fastdp
