// Counter-based Gaussian noise shared by the C++ (noise.cpp) and CUDA (noise.cu) kernels.
//
// Stream definition (the Triton kernel and the PyTorch reference in kernels/noise.py
// follow it too): element e of parameter k under a 64-bit seed is lane
// (e % (4*kGroup)) / kGroup of Philox4x32-10(key = (seed_lo, seed_hi),
// counter = (c_lo, c_hi, k, 0)) with c = (e / (4*kGroup)) * kGroup + e % kGroup.
// So each group of 4*kGroup elements is written as 4 contiguous runs, one per
// Philox output word. Words (w0, w1) and (w2, w3) each give two normals by
// Box-Muller: r = sqrt(-2 ln u) with u = (floor(w0 / 2) + ((w1 & 255) + 1) / 256) / 2^31
// in (0, 1], a uniform of 39 bits; angle = 2 pi (w1 & ~255) / 2^32, its top 24 bits;
// z = (r cos, r sin). The quadrant of the angle comes from the top two bits of w1, so
// the range reduction is exact; ln, sin and cos are short branchless polynomials (atanh
// and Taylor series) accurate to float32 rounding. |z| <= sqrt(78 ln 2) ~ 7.353, a tail
// of probability 2e-13.
#pragma once
#include <math.h>

#include <cstdint>

#if defined(__CUDACC__)
#define FASTDP_HD __host__ __device__ __forceinline__
#else
#define FASTDP_HD inline
#endif

namespace fastdp {

constexpr int kGroup = 256;  // Philox counters per group of 4*kGroup elements

FASTDP_HD uint32_t mulhi32(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

// Philox4x32 with 10 rounds; c is the counter on input and the output on return.
FASTDP_HD void philox4x32_10(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3,
                             uint32_t k0, uint32_t k1) {
#if defined(__CUDACC__)
#pragma unroll
#else
#pragma GCC unroll 10
#endif
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = mulhi32(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const uint32_t hi1 = mulhi32(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

FASTDP_HD float bits_to_float(int32_t i) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(i);
#else
  return __builtin_bit_cast(float, i);
#endif
}

FASTDP_HD int32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(f);
#else
  return __builtin_bit_cast(int32_t, f);
#endif
}

// -2 ln u for the u in (0, 1] of 39 random bits, the top 31 of w and the low 8 of `low`:
// u = ((w >> 1) + ((low & 255) + 1) / 256) / 2^31, at least 2^-39, so the normals reach
// |z| = 7.35 (with 31 bits they stopped at 6.556, a truncation of the Gaussian that a
// worst-case neighbour can detect: about 1e-10 sqrt(d) / sigma of delta per step; now 1e-12).
// Then u = m 2^e, m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s) with s = (m - 1)/(m + 1),
// |s| < 0.172, series to s^9.
FASTDP_HD float minus_two_log_unit(uint32_t w, uint32_t low) {
  const float fine = static_cast<float>(static_cast<int32_t>((low & 0xffu) + 1u)) * 0.00390625f;  // exact
  const float u = (static_cast<float>(static_cast<int32_t>(w >> 1)) + fine) * 4.656612873077392578125e-10f;
  const int32_t bits = float_to_bits(u);
  int32_t e = ((bits >> 23) & 0xff) - 127;
  const int32_t big = (bits & 0x007fffff) > 0x003504f3;  // mantissa above sqrt(2)
  const float m = bits_to_float((bits & 0x007fffff) | (big ? 0x3f000000 : 0x3f800000));
  e += big;
  const float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
  const float series = s2 * (1.0f / 3 + s2 * (1.0f / 5 + s2 * (1.0f / 7 + s2 * (1.0f / 9))));
  const float ln_u = static_cast<float>(e) * 0.693147180559945f + (2.0f * s + 2.0f * s * series);
  return -2.0f * ln_u;
}

// (cos, sin) of 2 pi w / 2^32: quadrant from the top bits, |phi| <= pi/4 Taylor series.
FASTDP_HD void sincos_turn(uint32_t w, float& c, float& s) {
  const uint32_t quadrant = (w + 0x20000000u) >> 30;
  const int32_t rest = static_cast<int32_t>(w - (quadrant << 30));  // [-2^29, 2^29)
  const float phi = static_cast<float>(rest) * 1.4629180792671596e-09f;  // (pi/2) / 2^30
  const float p2 = phi * phi;
  const float sn = phi * (1.0f + p2 * (-1.0f / 6 + p2 * (1.0f / 120 + p2 * (-1.0f / 5040 + p2 * (1.0f / 362880)))));
  const float cs = 1.0f + p2 * (-0.5f + p2 * (1.0f / 24 + p2 * (-1.0f / 720 + p2 * (1.0f / 40320 + p2 * (-1.0f / 3628800)))));
  const bool swap = quadrant & 1u;
  const float c_abs = swap ? sn : cs, s_abs = swap ? cs : sn;
  c = ((quadrant + 1u) & 2u) ? -c_abs : c_abs;
  s = (quadrant & 2u) ? -s_abs : s_abs;
}

// Two standard normals from two Philox words: the angle from the top 24 bits of w_angle,
// the radius from w_radius and the low 8 bits of w_angle.
FASTDP_HD void box_muller(uint32_t w_radius, uint32_t w_angle, float& z0, float& z1) {
  float c, s;
  sincos_turn(w_angle & 0xffffff00u, c, s);
  const float r = sqrtf(minus_two_log_unit(w_radius, w_angle));
  z0 = r * c;
  z1 = r * s;
}

}  // namespace fastdp
