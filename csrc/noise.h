// Fused DP noise kernel (CPU). See philox.h for the noise stream.
#pragma once
#include <cstdint>
#include <vector>

namespace fastdp {

// One parameter: `numel` contiguous float32 (or float64) values read from `src` and
// written to `dst` (which may alias `src`); `index` keys its noise stream.
struct NoiseTensor {
  const void* src;
  void* dst;
  int64_t numel;
  uint32_t index;
  bool is_double;
};

// dst = (src + std * z) / divisor for every tensor, z ~ N(0, 1) from (seed, index).
void noisy_average(const std::vector<NoiseTensor>& tensors, double std, double divisor, uint64_t seed);

}  // namespace fastdp
