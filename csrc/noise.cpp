// Fused DP noise for all parameters of a step: out = (s + std * z) / divisor, z ~ N(0, 1)
// from the counter-based stream of philox.h, generated in registers (no noise tensor)
// in one pass over memory.
#include "noise.h"

#include <algorithm>
#include <vector>

#include "philox.h"
#include "simd.h"

namespace fastdp {
namespace {

// One group of 4*kGroup elements starting at element `base` (all in range).
template <typename T>
__attribute__((always_inline)) inline void noise_group_full(const T* s, T* out, uint64_t group, uint32_t k0,
                                                            uint32_t k1, uint32_t param, T std, T divisor) {
  const uint64_t c_first = group * kGroup;
  const T* s0 = s + 4 * c_first;
  T* o0 = out + 4 * c_first;
#pragma omp simd
  for (int j = 0; j < kGroup; ++j) {
    const uint64_t c = c_first + j;
    uint32_t w0 = static_cast<uint32_t>(c), w1 = static_cast<uint32_t>(c >> 32), w2 = param, w3 = 0;
    philox4x32_10(w0, w1, w2, w3, k0, k1);
    float z0, z1, z2, z3;
    box_muller(w0, w1, z0, z1);
    box_muller(w2, w3, z2, z3);
    o0[j] = (s0[j] + std * static_cast<T>(z0)) / divisor;
    o0[kGroup + j] = (s0[kGroup + j] + std * static_cast<T>(z1)) / divisor;
    o0[2 * kGroup + j] = (s0[2 * kGroup + j] + std * static_cast<T>(z2)) / divisor;
    o0[3 * kGroup + j] = (s0[3 * kGroup + j] + std * static_cast<T>(z3)) / divisor;
  }
}

// The last, partial group: elements [4*kGroup*group, n).
template <typename T>
void noise_group_tail(const T* s, T* out, int64_t n, uint64_t group, uint32_t k0, uint32_t k1, uint32_t param,
                      T std, T divisor) {
  float z[4][kGroup];
  const uint64_t c_first = group * kGroup;
  for (int j = 0; j < kGroup; ++j) {
    const uint64_t c = c_first + j;
    uint32_t w0 = static_cast<uint32_t>(c), w1 = static_cast<uint32_t>(c >> 32), w2 = param, w3 = 0;
    philox4x32_10(w0, w1, w2, w3, k0, k1);
    box_muller(w0, w1, z[0][j], z[1][j]);
    box_muller(w2, w3, z[2][j], z[3][j]);
  }
  const int64_t base = static_cast<int64_t>(4 * c_first);
  for (int64_t e = base; e < n; ++e) {
    const int64_t within = e - base;
    out[e] = (s[e] + std * static_cast<T>(z[within / kGroup][within % kGroup])) / divisor;
  }
}

template <typename T>
__attribute__((always_inline)) inline void noise_groups(const NoiseTensor& t, uint64_t first, uint64_t count,
                                                        uint32_t k0, uint32_t k1, T std, T divisor) {
  const T* s = static_cast<const T*>(t.src);
  T* out = static_cast<T*>(t.dst);
  const uint64_t full = static_cast<uint64_t>(t.numel) / (4 * kGroup);
  for (uint64_t g = first; g < first + count; ++g) {
    if (g < full)
      noise_group_full<T>(s, out, g, k0, k1, t.index, std, divisor);
    else
      noise_group_tail<T>(s, out, t.numel, g, k0, k1, t.index, std, divisor);
  }
}

FASTDP_MULTIVERSION void noise_groups_f32(const NoiseTensor& t, uint64_t first, uint64_t count, uint32_t k0,
                                          uint32_t k1, double std, double divisor) {
  noise_groups<float>(t, first, count, k0, k1, static_cast<float>(std), static_cast<float>(divisor));
}

FASTDP_MULTIVERSION void noise_groups_f64(const NoiseTensor& t, uint64_t first, uint64_t count, uint32_t k0,
                                          uint32_t k1, double std, double divisor) {
  noise_groups<double>(t, first, count, k0, k1, std, divisor);
}

}  // namespace

void noisy_average(const std::vector<NoiseTensor>& tensors, double std, double divisor, uint64_t seed) {
  // Work items of up to kChunk groups, spread over all tensors, for one parallel loop.
  constexpr uint64_t kChunk = 16;
  struct Item {
    size_t tensor;
    uint64_t first, count;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t groups = (static_cast<uint64_t>(tensors[i].numel) + 4 * kGroup - 1) / (4 * kGroup);
    for (uint64_t g = 0; g < groups; g += kChunk) items.push_back({i, g, std::min(kChunk, groups - g)});
  }
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < static_cast<int64_t>(items.size()); ++n) {
    const Item& it = items[n];
    const NoiseTensor& t = tensors[it.tensor];
    if (t.is_double)
      noise_groups_f64(t, it.first, it.count, k0, k1, std, divisor);
    else
      noise_groups_f32(t, it.first, it.count, k0, k1, std, divisor);
  }
}

}  // namespace fastdp
