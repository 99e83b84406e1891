// Fused DP noise kernel (CPU). See philox.h for the noise stream.
#pragma once
#include <cstdint>
#include <vector>

namespace fastdp {

// One parameter: `numel` contiguous float32 values read from `src` and written to `dst`
// (which may alias `src`); `index` keys its noise stream. Float32 only: its normals are
// float32, on whose grid a float64 sum's low bits would show through the noise.
struct NoiseTensor {
  const void* src;
  void* dst;
  int64_t numel;
  uint32_t index;
};

// dst = (src + std * z) / divisor for every tensor, z ~ N(0, 1) from (seed, index).
void noisy_average(const std::vector<NoiseTensor>& tensors, double std, double divisor, uint64_t seed);

}  // namespace fastdp
