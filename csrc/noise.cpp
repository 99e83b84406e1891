// Fused DP noise for all parameters of a step: out = (s + std * z) / divisor, z ~ N(0, 1)
// from the counter-based stream of philox.h, generated in registers (no noise tensor)
// in one pass over memory.
#include "noise.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "philox.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

// The kernel body (noise_cpu_simd.h) is compiled once per instruction set, each in its
// own namespace, and picked at run time: AVX-512 and AVX2 where the CPU has them, the
// baseline ISA everywhere (SSE2 on x86-64, generic vectors elsewhere).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTDP_NOISE_DISPATCH 1
#endif
#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace fastdp {
namespace {

#if FASTDP_NOISE_DISPATCH
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define FASTDP_SIMD 512
namespace avx512 {
#include "noise_cpu_simd.h"
}  // namespace avx512
#undef FASTDP_SIMD
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define FASTDP_SIMD 256
namespace avx2 {
#include "noise_cpu_simd.h"
}  // namespace avx2
#undef FASTDP_SIMD
#pragma GCC pop_options
#endif

#if defined(__SSE2__)
#define FASTDP_SIMD 128
#else
#define FASTDP_SIMD 0
#endif
namespace baseline {
#include "noise_cpu_simd.h"
}  // namespace baseline
#undef FASTDP_SIMD

using NoiseGroupsFn = void (*)(const NoiseTensor&, uint64_t, uint64_t, uint32_t, uint32_t, double, double);

NoiseGroupsFn pick_noise_groups() {
#if FASTDP_NOISE_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return avx512::noise_groups;
  if (__builtin_cpu_supports("x86-64-v3")) return avx2::noise_groups;
#endif
  return baseline::noise_groups;
}

// Ask for transparent huge pages on the whole 2 MiB pages of a large output: a fresh
// allocation is then faulted in 2 MiB at a time instead of 4 KiB, which on large
// tensors costs more than the kernel itself. Only a hint, so failures are ignored.
void advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace

void noisy_average(const std::vector<NoiseTensor>& tensors, double std, double divisor, uint64_t seed) {
  static const NoiseGroupsFn noise_groups = pick_noise_groups();
  // Work items of up to kChunk groups (64K elements), spread over all tensors, handed out
  // dynamically: a thread that loses its core (a busy or shared machine) then holds up
  // one item, not a static share.
  constexpr uint64_t kChunk = 64;
  struct Item {
    size_t tensor;
    uint64_t first, count;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t groups = (static_cast<uint64_t>(tensors[i].numel) + 4 * kGroup - 1) / (4 * kGroup);
    for (uint64_t g = 0; g < groups; g += kChunk) items.push_back({i, g, std::min(kChunk, groups - g)});
    advise_huge_pages(tensors[i].dst, tensors[i].numel * sizeof(float));
  }
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma omp parallel for schedule(dynamic)
  for (int64_t n = 0; n < static_cast<int64_t>(items.size()); ++n) {
    const Item& it = items[n];
    noise_groups(tensors[it.tensor], it.first, it.count, k0, k1, std, divisor);
  }
}

}  // namespace fastdp
