// Fused DP noise on CUDA: dst = (src + std * z) / divisor for many tensors in one launch,
// z from the Philox stream of philox.h, as the C++ and Triton kernels draw it (float32 results agree up to
// rounding: FMA contraction, and compiled Triton divides and takes square roots approximately).
// Float32 only: its normals are float32, on whose grid a float64 sum's low bits would show.
// Plain CUDA without torch headers, built into a shared library by `make cuda-lib` and
// called through ctypes by fastdp/_cuda_ops.py.
#include <cuda_runtime.h>

#include "philox.h"

namespace fastdp {

// One tensor of a call, as laid out by fastdp/_cuda_ops.py: five int64 words.
struct DeviceNoiseTensor {
  int64_t src;          // device address of the float32 input
  int64_t dst;          // device address of the output (may equal src)
  int64_t numel;
  int64_t index;        // keys the tensor's noise stream
  int64_t first_group;  // groups of 4*kGroup elements in all earlier tensors
};

// Grid-stride over the groups of all tensors. A block of kGroup threads handles one group
// at a time: thread j draws counter j of the group and writes elements j, j + kGroup,
// j + 2 kGroup, j + 3 kGroup (coalesced). The tensor of a group is found by binary search
// over first_group, so no per-block table is needed.
__global__ void __launch_bounds__(kGroup) noisy_average_kernel(const DeviceNoiseTensor* tensors, int n_tensors,
                                                              int64_t total_groups, uint32_t k0, uint32_t k1,
                                                              float std, float divisor) {
  for (int64_t group = blockIdx.x; group < total_groups; group += gridDim.x) {
    int lo = 0, hi = n_tensors - 1;
    while (lo < hi) {  // last tensor whose first_group <= group
      const int mid = (lo + hi + 1) / 2;
      if (tensors[mid].first_group <= group) lo = mid; else hi = mid - 1;
    }
    const DeviceNoiseTensor t = tensors[lo];
    const int64_t local = group - t.first_group;
    const uint64_t c = static_cast<uint64_t>(local) * kGroup + threadIdx.x;
    uint32_t w0 = static_cast<uint32_t>(c), w1 = static_cast<uint32_t>(c >> 32);
    uint32_t w2 = static_cast<uint32_t>(t.index), w3 = 0;
    philox4x32_10(w0, w1, w2, w3, k0, k1);
    float z[4];
    box_muller(w0, w1, z[0], z[1]);
    box_muller(w2, w3, z[2], z[3]);
    const float* src = reinterpret_cast<const float*>(t.src);
    float* dst = reinterpret_cast<float*>(t.dst);
    const int64_t first = local * 4 * kGroup + threadIdx.x;
#pragma unroll
    for (int lane = 0; lane < 4; ++lane) {
      const int64_t e = first + lane * kGroup;
      if (e < t.numel) dst[e] = (src[e] + std * z[lane]) / divisor;
    }
  }
}

cudaError_t launch(const DeviceNoiseTensor* tensors, int n_tensors, int64_t total_groups, int max_blocks,
                   uint64_t seed, double std, double divisor, cudaStream_t stream) {
  if (n_tensors <= 0 || total_groups <= 0) return cudaSuccess;
  const int blocks = static_cast<int>(total_groups < max_blocks ? total_groups : max_blocks);
  noisy_average_kernel<<<blocks, kGroup, 0, stream>>>(tensors, n_tensors, total_groups,
                                                      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                                                      static_cast<float>(std), static_cast<float>(divisor));
  return cudaGetLastError();
}

}  // namespace fastdp

// Host launcher. `tensors` is a device array of n_tensors float32 entries; total_groups =
// sum of ceil(numel / (4 * kGroup)). Returns the launch's CUDA error code (0 on success).
// Named for float32: a library built before float64 was dropped (its launcher took a dtype
// flag) fails to load instead of being called with the wrong arguments.
extern "C" int fastdp_noisy_average_f32(const void* tensors, int n_tensors, int64_t total_groups, int max_blocks,
                                        uint64_t seed, double std, double divisor, void* stream) {
  return fastdp::launch(static_cast<const fastdp::DeviceNoiseTensor*>(tensors), n_tensors, total_groups, max_blocks,
                        seed, std, divisor, static_cast<cudaStream_t>(stream));
}

// The group size the launcher assumes (the Python side checks it against kernels/noise.py).
extern "C" int fastdp_noise_group() { return fastdp::kGroup; }
