// Fused DP noise on CUDA: dst = (src + std * z) / divisor for many tensors in one launch,
// z from the Philox stream of philox.h (same numbers as the C++ and Triton kernels).
// Plain CUDA, no torch headers; not bound to Python yet (see kernels/noise.py for the
// Triton version the package uses on GPUs). Compiled by `make cuda-check`.
#include <cuda_runtime.h>

#include "philox.h"

namespace fastdp {

struct DeviceNoiseTensor {
  const void* src;
  void* dst;
  int64_t numel;
  uint32_t index;  // keys the tensor's noise stream
};

// One block per group of 4*kGroup elements; thread j draws counter j of the group and
// writes elements j, j + kGroup, j + 2 kGroup, j + 3 kGroup (coalesced).
template <typename T>
__global__ void __launch_bounds__(kGroup) noisy_average_kernel(const DeviceNoiseTensor* tensors,
                                                              const int32_t* block_tensor,
                                                              const int64_t* block_group, uint32_t k0,
                                                              uint32_t k1, T std, T divisor) {
  const DeviceNoiseTensor t = tensors[block_tensor[blockIdx.x]];
  const uint64_t c = static_cast<uint64_t>(block_group[blockIdx.x]) * kGroup + threadIdx.x;
  uint32_t w0 = static_cast<uint32_t>(c), w1 = static_cast<uint32_t>(c >> 32), w2 = t.index, w3 = 0;
  philox4x32_10(w0, w1, w2, w3, k0, k1);
  float z[4];
  box_muller(w0, w1, z[0], z[1]);
  box_muller(w2, w3, z[2], z[3]);
  const T* src = static_cast<const T*>(t.src);
  T* dst = static_cast<T*>(t.dst);
  const int64_t first = static_cast<int64_t>(block_group[blockIdx.x]) * 4 * kGroup + threadIdx.x;
#pragma unroll
  for (int lane = 0; lane < 4; ++lane) {
    const int64_t e = first + lane * kGroup;
    if (e < t.numel) dst[e] = (src[e] + std * static_cast<T>(z[lane])) / divisor;
  }
}

}  // namespace fastdp

// Host launchers. All pointers are device pointers; block_tensor / block_group list, for
// each of n_blocks blocks, the tensor it works on and its group within that tensor.
extern "C" cudaError_t fastdp_noisy_average_f32(const fastdp::DeviceNoiseTensor* tensors, const int32_t* block_tensor,
                                                const int64_t* block_group, int n_blocks, uint64_t seed, float std,
                                                float divisor, cudaStream_t stream) {
  fastdp::noisy_average_kernel<float><<<n_blocks, fastdp::kGroup, 0, stream>>>(
      tensors, block_tensor, block_group, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), std,
      divisor);
  return cudaGetLastError();
}

extern "C" cudaError_t fastdp_noisy_average_f64(const fastdp::DeviceNoiseTensor* tensors, const int32_t* block_tensor,
                                                const int64_t* block_group, int n_blocks, uint64_t seed, double std,
                                                double divisor, cudaStream_t stream) {
  fastdp::noisy_average_kernel<double><<<n_blocks, fastdp::kGroup, 0, stream>>>(
      tensors, block_tensor, block_group, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), std,
      divisor);
  return cudaGetLastError();
}
