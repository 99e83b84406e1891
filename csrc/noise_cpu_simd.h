// Body of the CPU noise kernel for one instruction set. No include guard on purpose:
// noise.cpp includes it once per ISA, each time inside a namespace of its own and under
// `#pragma GCC target(...)` with FASTDP_SIMD set to the vector width in bits: 512
// (AVX-512), 256 (AVX2), 128 (SSE2) or 0 (no intrinsics, 128-bit generic vectors).
// <cstdint>, <algorithm>, <immintrin.h> (x86), philox.h and noise.h must be included
// before, outside it.
//
// SIMD layout: one vector holds kLanes consecutive Philox counters of a group, so its
// four output words are four vectors, each the z of kLanes consecutive elements of one
// of the group's four runs. Box-Muller runs on whole vectors and the normals of a group
// land in z[4][kGroup], which is exactly the group's element order; a plain loop then
// streams (s + std z) / divisor over the group (or the part of it the tensor has).
//
// Vectors are GCC vector extensions: arithmetic, comparisons (giving 0 / -1 lanes) and
// `mask ? a : b` are ordinary operators; intrinsics only where those fall short.

constexpr int kLanes = FASTDP_SIMD == 0 ? 4 : FASTDP_SIMD / 32;

typedef uint32_t VU32 __attribute__((vector_size(4 * kLanes)));
typedef int32_t VI32 __attribute__((vector_size(4 * kLanes)));
typedef uint64_t VU64 __attribute__((vector_size(4 * kLanes)));
typedef float VF32 __attribute__((vector_size(4 * kLanes)));

// 0, 1, ..., kLanes - 1.
inline VU32 lane_index() {
  VU32 v;
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}

// The 64-bit products of the even 32-bit lanes (one vpmuludq: the compilers turn a
// plain 64-bit vector product into a full 64x64 multiply or its emulation). The
// AVX-512 intrinsics are the all-lanes `maskz` forms, as GCC 12 warns about the
// undefined pass-through of the plain ones.
inline VU64 mul_even_u32(VU32 a, VU32 b) {
#if FASTDP_SIMD == 512
  return (VU64)_mm512_maskz_mul_epu32(0xff, (__m512i)a, (__m512i)b);
#elif FASTDP_SIMD == 256
  return (VU64)_mm256_mul_epu32((__m256i)a, (__m256i)b);
#elif FASTDP_SIMD == 128
  return (VU64)_mm_mul_epu32((__m128i)a, (__m128i)b);
#else
  return ((VU64)a & 0xffffffffu) * ((VU64)b & 0xffffffffu);
#endif
}

// High 32 bits of the 64-bit product a * b, lane by lane.
inline VU32 mul_hi_u32(VU32 a, VU32 b) {
  const VU64 even = mul_even_u32(a, b), odd = mul_even_u32((VU32)((VU64)a >> 32), (VU32)((VU64)b >> 32));
  return (VU32)((even >> 32) | (odd & 0xffffffff00000000u));
}

inline VF32 sqrt_f32(VF32 x) {
#if FASTDP_SIMD == 512
  return (VF32)_mm512_maskz_sqrt_ps(0xffff, (__m512)x);
#elif FASTDP_SIMD == 256
  return (VF32)_mm256_sqrt_ps((__m256)x);
#elif FASTDP_SIMD == 128
  return (VF32)_mm_sqrt_ps((__m128)x);
#else
  for (int i = 0; i < kLanes; ++i) x[i] = __builtin_sqrtf(x[i]);
  return x;
#endif
}

// Box-Muller on vectors: the lane-wise twin of fastdp::box_muller (philox.h), same
// operations in the same order, so the same float32 results up to FMA contraction.
inline void box_muller_v(VU32 w_radius, VU32 w_angle, VF32& z0, VF32& z1) {
  // r = sqrt(-2 ln u), ln u = e ln 2 + 2 atanh((m - 1) / (m + 1)); u of 39 bits (philox.h).
  const VF32 fine = __builtin_convertvector((VI32)((w_angle & 0xffu) + 1u), VF32) * 0.00390625f;
  const VF32 u = (__builtin_convertvector((VI32)(w_radius >> 1), VF32) + fine) * 4.656612873077392578125e-10f;
  const VI32 bits = (VI32)u, mantissa = bits & 0x007fffff;
  const VI32 big = mantissa > 0x003504f3;  // -1 where the mantissa is above sqrt(2)
  const VF32 m = (VF32)(mantissa | (big ? 0x3f000000 : 0x3f800000));
  const VI32 e = ((bits >> 23) & 0xff) - 127 - big;
  const VF32 s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
  const VF32 series = s2 * (1.0f / 3 + s2 * (1.0f / 5 + s2 * (1.0f / 7 + s2 * (1.0f / 9))));
  const VF32 ln_u = __builtin_convertvector(e, VF32) * 0.693147180559945f + (2.0f * s + 2.0f * s * series);
  const VF32 r = sqrt_f32(-2.0f * ln_u);
  // (cos, sin) of the angle (its top 24 bits): quadrant from the top bits, Taylor series on |phi| <= pi/4.
  const VU32 turn = w_angle & 0xffffff00u;
  const VU32 quadrant = (turn + 0x20000000u) >> 30;
  const VF32 phi = __builtin_convertvector((VI32)(turn - (quadrant << 30)), VF32) * 1.4629180792671596e-09f;
  const VF32 p2 = phi * phi;
  const VF32 sn = phi * (1.0f + p2 * (-1.0f / 6 + p2 * (1.0f / 120 + p2 * (-1.0f / 5040 + p2 * (1.0f / 362880)))));
  const VF32 cs =
      1.0f + p2 * (-0.5f + p2 * (1.0f / 24 + p2 * (-1.0f / 720 + p2 * (1.0f / 40320 + p2 * (-1.0f / 3628800)))));
  const VI32 swap = (quadrant & 1u) != 0;
  const VF32 c_abs = swap ? sn : cs, s_abs = swap ? cs : sn;
  // The signs of the quadrant, flipped as sign bits (bit 1 of the quadrant moved to bit 31).
  z0 = r * (VF32)((VU32)c_abs ^ (((quadrant + 1u) & 2u) << 30));
  z1 = r * (VF32)((VU32)s_abs ^ ((quadrant & 2u) << 30));
}

// z[w][j] = the normals of Philox word w at counter (c_lo + j, c_hi, param, 0), j < kGroup.
// The ten rounds are one serial chain per vector, so kBlocks vectors run interleaved
// to keep the multipliers busy.
constexpr int kBlocks = 4;
inline void group_normals(uint32_t c_lo, uint32_t c_hi, uint32_t param, uint32_t k0, uint32_t k1,
                          float (*z)[kGroup]) {
  const VU32 m0 = VU32{} + 0xD2511F53u, m1 = VU32{} + 0xCD9E8D57u;
  for (int j = 0; j < kGroup; j += kBlocks * kLanes) {
    VU32 c0[kBlocks], c1[kBlocks], c2[kBlocks], c3[kBlocks];
    for (int b = 0; b < kBlocks; ++b) {
      c0[b] = lane_index() + (c_lo + j + b * kLanes);
      c1[b] = VU32{} + c_hi;
      c2[b] = VU32{} + param;
      c3[b] = VU32{};
    }
    uint32_t key0 = k0, key1 = k1;
#pragma GCC unroll 10
    for (int round = 0; round < 10; ++round) {  // philox4x32_10 on vectors
      for (int b = 0; b < kBlocks; ++b) {
        const VU32 hi0 = mul_hi_u32(c0[b], m0), lo0 = c0[b] * m0, hi1 = mul_hi_u32(c2[b], m1), lo1 = c2[b] * m1;
        c0[b] = hi1 ^ c1[b] ^ key0;
        c1[b] = lo1;
        c2[b] = hi0 ^ c3[b] ^ key1;
        c3[b] = lo0;
      }
      key0 += 0x9E3779B9u;
      key1 += 0xBB67AE85u;
    }
    for (int b = 0; b < kBlocks; ++b) {
      VF32 z0, z1, z2, z3;
      box_muller_v(c0[b], c1[b], z0, z1);
      box_muller_v(c2[b], c3[b], z2, z3);
      const int jb = j + b * kLanes;
      __builtin_memcpy(&z[0][jb], &z0, sizeof z0);
      __builtin_memcpy(&z[1][jb], &z1, sizeof z1);
      __builtin_memcpy(&z[2][jb], &z2, sizeof z2);
      __builtin_memcpy(&z[3][jb], &z3, sizeof z3);
    }
  }
}

// Groups [first, first + count) of one tensor: out = (s + std z) * (1 / divisor), in float32.
inline void noise_groups(const NoiseTensor& t, uint64_t first, uint64_t count, uint32_t k0, uint32_t k1,
                         double std_wide, double divisor) {
  const float std = static_cast<float>(std_wide), inv_divisor = static_cast<float>(1.0 / divisor);
  const float* s = static_cast<const float*>(t.src);
  float* out = static_cast<float*>(t.dst);
  alignas(64) float z[4][kGroup];
  for (uint64_t g = first; g < first + count; ++g) {
    const uint64_t c = g * kGroup;  // its low word is a multiple of kGroup: c_lo + j never carries
    group_normals(static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32), t.index, k0, k1, z);
    const int64_t base = static_cast<int64_t>(4 * c), n = std::min<int64_t>(4 * kGroup, t.numel - base);
    const float* zf = &z[0][0];
    const float* sg = s + base;
    float* og = out + base;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) og[i] = (sg[i] + std * zf[i]) * inv_divisor;
  }
}
