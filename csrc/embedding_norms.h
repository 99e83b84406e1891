// Per-sample squared norm of an embedding's weight gradient (CPU).
#pragma once
#include <cstdint>

namespace fastdp {

// ids: (B, T) token ids; g: (B, T, D) contiguous; out: (B,) float64.
// out[i] = sum over distinct ids v != padding_idx of || sum_{t: ids[i,t] = v} g[i,t] ||^2.
template <typename T>
void embedding_sq_norms(const int64_t* ids, const T* g, int64_t batch, int64_t seq, int64_t dim,
                        bool has_padding, int64_t padding_idx, double* out);

}  // namespace fastdp
