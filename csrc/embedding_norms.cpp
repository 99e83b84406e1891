// Embedding norm by per-sample sort of the token ids and segment sums: O(B T (D + log T)).
#include "embedding_norms.h"

#include <algorithm>
#include <numeric>
#include <vector>

namespace fastdp {

template <typename T>
void embedding_sq_norms(const int64_t* ids, const T* g, int64_t batch, int64_t seq, int64_t dim,
                        bool has_padding, int64_t padding_idx, double* out) {
#pragma omp parallel
  {
    std::vector<int64_t> order(seq);
    std::vector<double> run(dim);
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t* tok = ids + i * seq;
      const T* rows = g + i * seq * dim;
      int64_t n = 0;
      for (int64_t t = 0; t < seq; ++t)
        if (!(has_padding && tok[t] == padding_idx)) order[n++] = t;
      std::sort(order.begin(), order.begin() + n,
                [tok](int64_t x, int64_t y) { return tok[x] < tok[y] || (tok[x] == tok[y] && x < y); });
      double total = 0.0;
      for (int64_t start = 0, end; start < n; start = end) {
        end = start + 1;
        while (end < n && tok[order[end]] == tok[order[start]]) ++end;
        const T* first = rows + order[start] * dim;
        double sq = 0.0;
        if (end - start == 1) {  // a token seen once: its row's own norm
#pragma omp simd reduction(+ : sq)
          for (int64_t k = 0; k < dim; ++k) sq += static_cast<double>(first[k]) * first[k];
        } else {
          for (int64_t k = 0; k < dim; ++k) run[k] = first[k];
          for (int64_t r = start + 1; r < end; ++r) {
            const T* row = rows + order[r] * dim;
#pragma omp simd
            for (int64_t k = 0; k < dim; ++k) run[k] += row[k];
          }
#pragma omp simd reduction(+ : sq)
          for (int64_t k = 0; k < dim; ++k) sq += run[k] * run[k];
        }
        total += sq;
      }
      out[i] = total;
    }
  }
}

template void embedding_sq_norms<float>(const int64_t*, const float*, int64_t, int64_t, int64_t, bool, int64_t,
                                        double*);
template void embedding_sq_norms<double>(const int64_t*, const double*, int64_t, int64_t, int64_t, bool, int64_t,
                                         double*);

}  // namespace fastdp
