// Tiled per-sample linear-layer and 2-D convolution gradient norms (see linear_norms.h).
//
// Both routes share one register-blocked micro-kernel: MR rows, each one 64-byte vector of
// W lanes (16 floats / 8 doubles) wide, accumulated over a reduction axis of length n from a
// panel of n vectors and one broadcast scalar per row and step. Products are summed in the
// input dtype within a 64 x 64 tile; tile entries are squared and summed in float64.
#include "linear_norms.h"

#include <algorithm>
#include <memory>
#include <new>
#include <optional>
#include <type_traits>
#include <vector>

#include "simd.h"  // FASTDP_MULTIVERSION: AVX-512 / AVX2 / baseline clones, picked at load time

namespace fastdp {
namespace {

constexpr int MR = 8;         // rows of a micro-tile (broadcast operand)
constexpr int64_t TB = 64;    // tile edge on T (ghost) and on p and d (direct); multiple of MR and W
constexpr int64_t KC = 128;   // ghost: steps of the Gram reduction per pass over a tile
constexpr int64_t TC = 64;    // direct: steps of T per pass over a tile

// A 64-byte vector, lowered by GCC/Clang to the clone's ISA (one zmm, two ymm or four xmm),
// and the same vector at any element-aligned address (for loads from packed panels).
template <typename F>
struct VecOf {
  typedef F type __attribute__((vector_size(64)));
  typedef F unaligned __attribute__((vector_size(64), aligned(sizeof(F)), may_alias));
  typedef std::conditional_t<sizeof(F) == 4, int32_t, int64_t> index __attribute__((vector_size(64)));
};
template <typename F>
using Vec = typename VecOf<F>::type;
template <typename F>
constexpr int kLanes = 64 / sizeof(F);

template <typename F>
__attribute__((always_inline)) inline const typename VecOf<F>::unaligned& load(const F* p) {
  return *reinterpret_cast<const typename VecOf<F>::unaligned*>(p);
}

// out = kLanes<F> consecutive elements of type R from any element-aligned address (float to
// double: exact). An out-parameter: a 64-byte vector return value would change the baseline ABI.
template <typename F, typename R>
__attribute__((always_inline)) inline void load_as(const R* p, Vec<F>& out) {
  if constexpr (std::is_same_v<F, R>) {
    out = load(p);
  } else {
    typedef R Narrow __attribute__((vector_size(sizeof(R) * kLanes<F>), aligned(sizeof(R)), may_alias));
    out = __builtin_convertvector(*reinterpret_cast<const Narrow*>(p), Vec<F>);
  }
}

template <typename F>
__attribute__((always_inline)) inline void store(F* p, const Vec<F>& v) {
  *reinterpret_cast<typename VecOf<F>::unaligned*>(p) = v;
}

template <typename F>
__attribute__((always_inline)) inline double lane_sum(const Vec<F>& v) {
  double s = 0.0;
  for (int j = 0; j < kLanes<F>; ++j) s += v[j];
  return s;
}

// 64-byte-aligned per-thread scratch of n elements.
template <typename F>
struct Scratch {
  struct Free {
    void operator()(F* p) const { ::operator delete(p, std::align_val_t(64)); }
  };
  std::unique_ptr<F, Free> ptr;
  explicit Scratch(int64_t n)
      : ptr(static_cast<F*>(::operator new(sizeof(F) * std::max<int64_t>(n, 1), std::align_val_t(64)))) {}
  F* get() const { return ptr.get(); }
};

// acc[r] += sum_{k < n} panel[k * pstep .. k * pstep + W) * rows[r][k * step], r < MR. The rows
// may be of a narrower type R (float rows into float64 Grams): each scalar is widened exactly.
template <typename F, typename R>
__attribute__((always_inline)) inline void micro_kernel(const R* const* rows, int64_t step, const F* panel,
                                                        int64_t pstep, int64_t n, Vec<F>* acc) {
  Vec<F> c[MR];
  for (int r = 0; r < MR; ++r) c[r] = acc[r];
  const R* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = rows[r];
  for (int64_t k = 0; k < n; ++k) {
    const Vec<F> col = load(panel + k * pstep);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      c[r] += col * static_cast<F>(x[r][0]);
      x[r] += step;
    }
  }
  for (int r = 0; r < MR; ++r) acc[r] = c[r];
}

// The same for two column blocks at once (acc0 from panel0, acc1 from panel1): each broadcast
// scalar feeds two FMAs, so 16 FMAs per step take 10 loads instead of 18.
template <typename F, typename R>
__attribute__((always_inline)) inline void micro_kernel2(const R* const* rows, int64_t step, const F* panel0,
                                                         int64_t pstep0, const F* panel1, int64_t pstep1, int64_t n,
                                                         Vec<F>* acc0, Vec<F>* acc1) {
  Vec<F> c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) {
    c0[r] = acc0[r];
    c1[r] = acc1[r];
  }
  const R* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = rows[r];
  for (int64_t k = 0; k < n; ++k) {
    const Vec<F> col0 = load(panel0 + k * pstep0), col1 = load(panel1 + k * pstep1);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const F xr = static_cast<F>(x[r][0]);
      c0[r] += col0 * xr;
      c1[r] += col1 * xr;
      x[r] += step;
    }
  }
  for (int r = 0; r < MR; ++r) {
    acc0[r] = c0[r];
    acc1[r] = c1[r];
  }
}

#if defined(__GNUC__) && !defined(__clang__)
// Transposes the W x W block held in v (v[i] = row i) in place: log2(W) rounds, each swapping
// the off-diagonal b x b sub-blocks of every 2b x 2b block with two-vector shuffles.
template <typename F>
__attribute__((always_inline)) inline void transpose_block(Vec<F>* v) {
  constexpr int W = kLanes<F>;
  typename VecOf<F>::index lo, hi;
#pragma GCC unroll 4
  for (int b = W / 2; b >= 1; b /= 2) {
    for (int j = 0; j < W; ++j) {  // lanes of (top, bottom): left half of a 2b block stays
      lo[j] = (j & b) ? W + j - b : j;
      hi[j] = (j & b) ? W + j : j + b;
    }
    for (int r = 0; r < W; ++r)
      if (!(r & b)) {
        const Vec<F> top = v[r], bottom = v[r + b];
        v[r] = __builtin_shuffle(top, bottom, lo);
        v[r + b] = __builtin_shuffle(top, bottom, hi);
      }
  }
}
#define LINEAR_NORMS_TRANSPOSE 1
#endif

// Ghost panel of rows [t0, t1) of one sample's (T, K) matrix x, transposed in blocks of W rows:
// panel[(c * K + k) * W + j] = x[t0 + c W + j, k], zero past t1. Whole blocks are copied as
// vectors when x is (K, T)-major and transposed W x W at a time when it is (T, K)-major.
template <typename F, typename R>
__attribute__((always_inline)) inline void pack_rows_transposed(const R* x, int64_t st, int64_t sk, int64_t K,
                                                                int64_t t0, int64_t t1, F* panel) {
  constexpr int W = kLanes<F>;
  for (int64_t c0 = t0; c0 < t1; c0 += W) {
    const int64_t rows = std::min<int64_t>(W, t1 - c0);
    F* dst = panel + ((c0 - t0) / W) * K * W;
    int64_t k0 = 0;  // columns [0, k0) done with vectors
    if (rows == W && st == 1) {
      for (; k0 < K; ++k0) {
        Vec<F> v;
        load_as<F>(x + c0 + k0 * sk, v);
        store(dst + k0 * W, v);
      }
    }
#ifdef LINEAR_NORMS_TRANSPOSE
    if (rows == W && sk == 1) {
      for (; k0 + W <= K; k0 += W) {
        Vec<F> v[W];
        for (int j = 0; j < W; ++j) load_as<F>(x + (c0 + j) * st + k0, v[j]);
        transpose_block<F>(v);
        for (int j = 0; j < W; ++j) store(dst + (k0 + j) * W, v[j]);
      }
    }
#endif
    if (k0 == K) continue;
    if (rows < W) std::fill(dst + k0 * W, dst + K * W, F(0));
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t k = k0; k < K; ++k) dst[k * W + j] = x[(c0 + j) * st + k * sk];
  }
}

// Gram tile of x (T rows of length K, strides st, sk) between rows [s0, s1) and the packed
// column tile starting at row t0 (`blocks` blocks of W): acc[(rg * blocks + c) * MR + r] +=
// x_{s0 + rg MR + r} . x_{t0 + c W + lane}, in passes of KC steps of k so that the panel
// slices stay in L1. Micro-tiles entirely below the diagonal are skipped; rows past T read
// row T-1 (their weight is 0).
template <typename F, typename R>
__attribute__((always_inline)) inline void gram_tile(const R* x, int64_t st, int64_t sk, int64_t K, int64_t seq,
                                                     const F* panel, int64_t s0, int64_t s1, int64_t t0,
                                                     int64_t blocks, Vec<F>* acc) {
  constexpr int W = kLanes<F>;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t n = std::min(KC, K - k0);
    for (int64_t r0 = s0; r0 < s1; r0 += MR) {
      const R* rows[MR];
      for (int r = 0; r < MR; ++r) rows[r] = x + std::min(r0 + r, seq - 1) * st + k0 * sk;
      Vec<F>* row_acc = acc + ((r0 - s0) / MR) * blocks * MR;
      int64_t c = 0;
      while (c < blocks && r0 >= t0 + (c + 1) * W) ++c;  // blocks entirely below the diagonal
      for (; c + 1 < blocks; c += 2)
        micro_kernel2(rows, sk, panel + (c * K + k0) * W, W, panel + ((c + 1) * K + k0) * W, W, n, row_acc + c * MR,
                      row_acc + (c + 1) * MR);
      if (c < blocks) micro_kernel(rows, sk, panel + (c * K + k0) * W, W, n, row_acc + c * MR);
    }
  }
}

// Ghost work item: column tile [t0, t1) of sample (a, g) (rows of length d and p). Returns
// sum over s < t1, t in the tile of w(s, t) (a_s . a_t)(g_s . g_t) with w = 2 above the
// diagonal, 1 on it, 0 below, so that the tiles of one sample add up to the full sum.
// Scratch: panels pa (TB x d), pg (TB x p); Gram tiles ga, gg (TB x TB each).
template <typename F, typename R>
__attribute__((always_inline)) inline double ghost_tile(const R* a, int64_t sat, int64_t sad, int64_t d,
                                                        const R* g, int64_t sgt, int64_t sgp, int64_t p,
                                                        int64_t seq, int64_t t0, int64_t t1, F* pa, F* pg,
                                                        Vec<F>* ga, Vec<F>* gg) {
  constexpr int W = kLanes<F>;
  pack_rows_transposed(a, sat, sad, d, t0, t1, pa);
  pack_rows_transposed(g, sgt, sgp, p, t0, t1, pg);
  // weight[OFF + c0 - s + j] = w(s, c0 + j) for the micro-tiles that straddle the diagonal.
  constexpr int OFF = W + MR - 2;
  F weight[2 * (W + MR)];
  for (int x = 0; x < 2 * (W + MR); ++x) weight[x] = x > OFF ? F(2) : x == OFF ? F(1) : F(0);
  const int64_t blocks = (t1 - t0 + W - 1) / W;
  double total = 0.0;
  for (int64_t s0 = 0; s0 < t1; s0 += TB) {  // row tiles S <= this column tile
    const int64_t s1 = std::min(s0 + TB, t1), groups = (s1 - s0 + MR - 1) / MR;
    std::fill(ga, ga + groups * blocks * MR, Vec<F>{});
    std::fill(gg, gg + groups * blocks * MR, Vec<F>{});
    gram_tile(a, sat, sad, d, seq, pa, s0, s1, t0, blocks, ga);
    gram_tile(g, sgt, sgp, p, seq, pg, s0, s1, t0, blocks, gg);
    Vec<F> tile_sum = {};
    for (int64_t r0 = s0; r0 < s1; r0 += MR) {
      for (int64_t c = 0; c < blocks; ++c) {
        const int64_t c0 = t0 + c * W, v = (((r0 - s0) / MR) * blocks + c) * MR;
        if (r0 >= c0 + W) continue;  // entirely below the diagonal
        if (r0 + MR <= c0) {         // entirely above
          Vec<F> sum = {};
          for (int r = 0; r < MR; ++r) sum += ga[v + r] * gg[v + r];
          tile_sum += sum + sum;
        } else {
          for (int r = 0; r < MR; ++r) tile_sum += ga[v + r] * gg[v + r] * load(weight + OFF + c0 - (r0 + r));
        }
      }
    }
    total += lane_sum<F>(tile_sum);
  }
  return total;
}

// The ghost route in float64 whatever the input dtype. Its sum of (a_s . a_t)(g_s . g_t) can
// cancel to far less than its terms (a sample whose per-position gradients nearly cancel): with
// Grams rounded in float32 the error is ~1e-7 (sum_s |a_s||g_s|)^2, and such a sample's norm
// came out near 0, or negative, so that it escaped clipping. A float32 product is exact in
// float64, so float64 Grams leave an error ~1e-16 of that. Float rows are read in place and
// widened as they are used (each broadcast scalar, each packed panel element).
struct GhostScratch {
  Scratch<double> pa, pg;       // packed column tiles of a and g
  Scratch<Vec<double>> ga, gg;  // Gram tiles
  GhostScratch(int64_t d, int64_t p)
      : pa(TB * d), pg(TB * p), ga(TB * TB / kLanes<double>), gg(TB * TB / kLanes<double>) {}
};

// The tile routines compiled per ISA, one overload per input dtype (the ghost tile in float64).
FASTDP_MULTIVERSION double ghost_tile_isa(const float* a, int64_t sat, int64_t sad, int64_t d, const float* g,
                                          int64_t sgt, int64_t sgp, int64_t p, int64_t seq, int64_t t0, int64_t t1,
                                          GhostScratch& w) {
  return ghost_tile<double>(a, sat, sad, d, g, sgt, sgp, p, seq, t0, t1, w.pa.get(), w.pg.get(), w.ga.get(),
                            w.gg.get());
}

FASTDP_MULTIVERSION double ghost_tile_isa(const double* a, int64_t sat, int64_t sad, int64_t d, const double* g,
                                          int64_t sgt, int64_t sgp, int64_t p, int64_t seq, int64_t t0, int64_t t1,
                                          GhostScratch& w) {
  return ghost_tile<double>(a, sat, sad, d, g, sgt, sgp, p, seq, t0, t1, w.pa.get(), w.pg.get(), w.ga.get(),
                            w.gg.get());
}

// Direct work item: the (j0..j1) x (k0..k1) tile of g^T a for one sample, accumulated over T
// in chunks of TC rows, then square-summed in float64. Vectors of a are read in place when its rows are
// contiguous and the block is whole, else packed into pa (2 x TC x W, zero past k1); scalars of g
// are read in place, row j from g_rows[j - j0] at steps of sgt (rows need not be evenly
// spaced); rows past j1 repeat row j1 - 1 and are left out of the sum.
template <typename F>
__attribute__((always_inline)) inline double direct_tile(const F* a, int64_t sat, int64_t sad,
                                                         const F* const* g_rows, int64_t sgt, int64_t seq, int64_t j0,
                                                         int64_t j1, int64_t k0, int64_t k1, F* pa,
                                                         Vec<F>* tile) {
  constexpr int W = kLanes<F>;
  const int64_t row_blocks = (j1 - j0 + MR - 1) / MR, col_blocks = (k1 - k0 + W - 1) / W;
  std::fill(tile, tile + row_blocks * col_blocks * MR, Vec<F>{});
  for (int64_t t0 = 0; t0 < seq; t0 += TC) {
    const int64_t n = std::min(TC, seq - t0);
    // Panel of column block c for rows [t0, t0 + n): in place when whole and contiguous, else
    // packed into pa + slot * TC * W.
    auto panel_of = [&](int64_t c, int slot, int64_t& pstep) -> const F* {
      const int64_t kc = k0 + c * W;
      if (sad == 1 && kc + W <= k1) {
        pstep = sat;
        return a + t0 * sat + kc;
      }
      F* packed = pa + slot * TC * W;
      for (int64_t t = 0; t < n; ++t)
        for (int j = 0; j < W; ++j) packed[t * W + j] = kc + j < k1 ? a[(t0 + t) * sat + (kc + j) * sad] : F(0);
      pstep = W;
      return packed;
    };
    for (int64_t c = 0; c < col_blocks; c += 2) {
      const bool pair = c + 1 < col_blocks;
      int64_t pstep0 = 0, pstep1 = 0;
      const F* panel0 = panel_of(c, 0, pstep0);
      const F* panel1 = pair ? panel_of(c + 1, 1, pstep1) : nullptr;
      for (int64_t b = 0; b < row_blocks; ++b) {
        const F* rows[MR];
        for (int r = 0; r < MR; ++r) rows[r] = g_rows[std::min(b * MR + r, j1 - j0 - 1)] + t0 * sgt;
        Vec<F>* acc = tile + (b * col_blocks + c) * MR;
        if (pair)
          micro_kernel2(rows, sgt, panel0, pstep0, panel1, pstep1, n, acc, acc + MR);
        else
          micro_kernel(rows, sgt, panel0, pstep0, n, acc);
      }
    }
  }
  // Squared in float64: a float32 square overflows past 1.8e19 (a finite sample's norm would
  // be infinite, and the sample dropped instead of clipped).
  constexpr int WD = kLanes<double>;
  Vec<double> sum = {};
  for (int64_t j = 0; j < j1 - j0; ++j)
    for (int64_t c = 0; c < col_blocks; ++c) {
      const F* v = reinterpret_cast<const F*>(&tile[((j / MR) * col_blocks + c) * MR + j % MR]);
      for (int h = 0; h < W; h += WD) {
        Vec<double> wide;
        load_as<double>(v + h, wide);
        sum += wide * wide;
      }
    }
  return lane_sum<double>(sum);
}

FASTDP_MULTIVERSION double direct_tile_isa(const float* a, int64_t sat, int64_t sad, const float* const* g_rows,
                                           int64_t sgt, int64_t seq, int64_t j0, int64_t j1, int64_t k0, int64_t k1,
                                           float* pa, Vec<float>* tile) {
  return direct_tile(a, sat, sad, g_rows, sgt, seq, j0, j1, k0, k1, pa, tile);
}

FASTDP_MULTIVERSION double direct_tile_isa(const double* a, int64_t sat, int64_t sad, const double* const* g_rows,
                                           int64_t sgt, int64_t seq, int64_t j0, int64_t j1, int64_t k0, int64_t k1,
                                           double* pa, Vec<double>* tile) {
  return direct_tile(a, sat, sad, g_rows, sgt, seq, j0, j1, k0, k1, pa, tile);
}

// out[i] = sum of partial[i * per_sample ...] in order (deterministic for any thread count).
void sum_partials(const std::vector<double>& partial, int64_t batch, int64_t per_sample, double* out) {
  for (int64_t i = 0; i < batch; ++i) {
    double s = 0.0;
    for (int64_t u = 0; u < per_sample; ++u) s += partial[i * per_sample + u];
    out[i] = s;
  }
}

}  // namespace

template <typename F>
void linear_sq_norms_ghost(const Strided3<F>& a, const Strided3<F>& g, double* out) {
  const int64_t batch = a.batch, seq = a.seq, tiles = (seq + TB - 1) / TB;
  std::vector<double> partial(batch * tiles);
#pragma omp parallel
  {
    GhostScratch scratch(a.dim, g.dim);
    // Items (sample, column tile); tile u costs ~u + 1 row tiles, hence dynamic scheduling.
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < batch * tiles; ++item) {
      const int64_t i = item / tiles, t0 = (item % tiles) * TB, t1 = std::min(seq, t0 + TB);
      partial[item] = ghost_tile_isa(a.data + i * a.sb, a.st, a.sk, a.dim, g.data + i * g.sb, g.st, g.sk, g.dim, seq,
                                     t0, t1, scratch);
    }
  }
  sum_partials(partial, batch, tiles, out);
}

template <typename F>
void linear_sq_norms_direct(const Strided3<F>& a, const Strided3<F>& g, double* out) {
  const int64_t batch = a.batch, seq = a.seq;
  const int64_t p_tiles = (g.dim + TB - 1) / TB, d_tiles = (a.dim + TB - 1) / TB, tiles = p_tiles * d_tiles;
  std::vector<double> partial(batch * tiles);
#pragma omp parallel
  {
    Scratch<F> pa(2 * TC * kLanes<F>);
    Scratch<Vec<F>> tile(TB * TB / kLanes<F>);
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < batch * tiles; ++item) {
      const int64_t i = item / tiles, j0 = (item % tiles) / d_tiles * TB, k0 = (item % d_tiles) * TB;
      const int64_t j1 = std::min(g.dim, j0 + TB), k1 = std::min(a.dim, k0 + TB);
      const F* ai = a.data + i * a.sb;
      const F* gi = g.data + i * g.sb;
      const F* g_rows[TB];
      for (int64_t j = j0; j < j1; ++j) g_rows[j - j0] = gi + j * g.sk;
      partial[item] = direct_tile_isa(ai, a.st, a.sk, g_rows, g.st, seq, j0, j1, k0, k1, pa.get(), tile.get());
    }
  }
  sum_partials(partial, batch, tiles, out);
}

template void linear_sq_norms_ghost<float>(const Strided3<float>&, const Strided3<float>&, double*);
template void linear_sq_norms_ghost<double>(const Strided3<double>&, const Strided3<double>&, double*);
template void linear_sq_norms_direct<float>(const Strided3<float>&, const Strided3<float>&, double*);
template void linear_sq_norms_direct<double>(const Strided3<double>&, const Strided3<double>&, double*);

namespace {

// Layout of one (sample, group)'s patches, "wide": output positions t = oy * V + ox with ox
// running over the whole width V of the stride-phase images below, so that every patch
// element is a shift of one flat buffer. Positions with ox >= OW are padding: their output
// gradient is set to zero, so they add nothing (about V / OW times the work of a compact
// layout, traded for whole rows read in place or copied instead of per-element gathers).
struct WideLayout {
  int64_t U, V;      // rows and columns of one phase image: ceil((H + 2 ph) / sh), ceil((W + 2 pw) / sw)
  int64_t T;         // OH * V wide positions
  int64_t images;    // sh * sw phases x channels
  explicit WideLayout(const Conv2dGeometry& c, int64_t channels)
      : U((c.height + 2 * c.pad_h + c.stride_h - 1) / c.stride_h),
        V((c.width + 2 * c.pad_w + c.stride_w - 1) / c.stride_w),
        T(c.out_height * V),
        images(c.stride_h * c.stride_w * channels) {}
  // Elements of the phase buffer: the images and V zeros that the last shifts may read.
  int64_t phase_elements() const { return images * U * V + V; }
};

// Visits the rows of the stride-phase images of one sample's group (see phase_images) with
// where they come from in x: fn(image_row, x_row, v_lo, v_hi, shift), offsets in elements;
// columns [v_lo, v_hi) of image row image_row hold x[x_row + v * sw + shift], the others are
// zero padding, and x_row < 0 marks a row wholly outside x.
template <typename Fn>
__attribute__((always_inline)) inline void for_each_phase_row(const Conv2dGeometry& c, int64_t channels,
                                                              const WideLayout& w, Fn&& fn) {
  for (int64_t phy = 0; phy < c.stride_h; ++phy)
    for (int64_t phx = 0; phx < c.stride_w; ++phx) {
      const int64_t shift = phx - c.pad_w;  // ix = v * sw + shift
      const int64_t v_lo = std::min(w.V, shift >= 0 ? 0 : (-shift + c.stride_w - 1) / c.stride_w);
      const int64_t v_hi = std::max(v_lo, std::min(w.V, (c.width - shift + c.stride_w - 1) / c.stride_w));
      for (int64_t ch = 0; ch < channels; ++ch) {
        const int64_t image = ((phy * c.stride_w + phx) * channels + ch) * w.U * w.V;
        for (int64_t u = 0; u < w.U; ++u) {
          const int64_t iy = u * c.stride_h + phy - c.pad_h;
          const bool inside = iy >= 0 && iy < c.height;
          fn(image + u * w.V, inside ? (ch * c.height + iy) * c.width : -1, v_lo, v_hi, shift);
        }
      }
    }
}

// The zero-padded input of one sample's group split by stride phase: image (phy * sw + phx)
// * channels + ch holds x[ch, u * sh + phy - ph, v * sw + phx - pw] at [u, v] (0 outside x).
// Tap (ki, kj) of output (oy, ox) then sits in image (ki dh % sh, kj dw % sw) at
// [oy + ki dh / sh, ox + kj dw / sw]. Each row: zeros, the columns inside x, zeros.
template <typename F>
__attribute__((always_inline)) inline void phase_images(const F* x, const Conv2dGeometry& c, int64_t channels,
                                                        const WideLayout& w, F* out) {
  const int64_t sw = c.stride_w;
  for_each_phase_row(c, channels, w, [&](int64_t image_row, int64_t x_row, int64_t v_lo, int64_t v_hi, int64_t shift) {
    F* dst = out + image_row;
    if (x_row < 0) return std::fill(dst, dst + w.V, F(0));
    std::fill(dst, dst + v_lo, F(0));
    for (int64_t v = v_lo; v < v_hi; ++v) dst[v] = x[x_row + v * sw + shift];
    std::fill(dst + v_hi, dst + w.V, F(0));
  });
  std::fill(out + w.images * w.U * w.V, out + w.phase_elements(), F(0));
}

// The inverse of phase_images: every element of x (one sample's group) read back from the
// phase images `in` (followed by at least one vector of readable slack); the padding is
// dropped. Row by row of x for horizontal strides 1 (a copy) and 2 (two phase rows
// interleaved, a vector at a time where the compiler has the shuffles), else element by element.
template <typename F>
__attribute__((always_inline)) inline void unphase_images(const F* in, const Conv2dGeometry& c, int64_t channels,
                                                          const WideLayout& w, F* x) {
  const int64_t sw = c.stride_w, pw = c.pad_w, width = c.width;
  if (sw > 2) {
    for_each_phase_row(c, channels, w, [&](int64_t image_row, int64_t x_row, int64_t v_lo, int64_t v_hi,
                                           int64_t shift) {
      if (x_row < 0) return;
      for (int64_t v = v_lo; v < v_hi; ++v) x[x_row + v * sw + shift] = in[image_row + v];
    });
    return;
  }
  for (int64_t ch = 0; ch < channels; ++ch)
    for (int64_t iy = 0; iy < c.height; ++iy) {
      const int64_t phy = (iy + c.pad_h) % c.stride_h, u = (iy + c.pad_h) / c.stride_h;
      auto phase_row = [&](int64_t phx) { return in + (((phy * sw + phx) * channels + ch) * w.U + u) * w.V; };
      F* dst = x + (ch * c.height + iy) * width;
      if (sw == 1) {
        std::copy(phase_row(0) + pw, phase_row(0) + pw + width, dst);
        continue;
      }
      // x[2j] = even[j], x[2j + 1] = odd[j]
      const F* even = phase_row(pw % 2) + pw / 2;
      const F* odd = phase_row((pw + 1) % 2) + (pw + 1) / 2;
      int64_t j = 0;
#ifdef LINEAR_NORMS_TRANSPOSE
      constexpr int W = kLanes<F>;
      typename VecOf<F>::index low;
      for (int k = 0; k < W; ++k) low[k] = k / 2 + (k % 2) * W;
      for (; 2 * (j + W / 2) <= width; j += W / 2)  // reads stay within the images and their slack
        store(dst + 2 * j, __builtin_shuffle(Vec<F>(load(even + j)), Vec<F>(load(odd + j)), low));
#endif
      for (; 2 * j < width; ++j) {
        dst[2 * j] = even[j];
        if (2 * j + 1 < width) dst[2 * j + 1] = odd[j];
      }
    }
}

// Patch row (ch * KH + ki) * KW + kj in the wide layout is the T consecutive elements of its
// phase image from `shift` on (patch_row_offset: in the whole phase buffer): the direct route
// reads the rows there, the ghost route copies them into a (d, T) matrix.
struct PatchTap {
  int64_t image, shift;
};

inline PatchTap patch_tap(const Conv2dGeometry& c, int64_t channels, const WideLayout& w, int64_t row) {
  const int64_t ch = row / (c.kernel_h * c.kernel_w), ki = row / c.kernel_w % c.kernel_h, kj = row % c.kernel_w;
  const int64_t dy = ki * c.dilation_h, dx = kj * c.dilation_w;
  return {((dy % c.stride_h) * c.stride_w + dx % c.stride_w) * channels + ch,
          dy / c.stride_h * w.V + dx / c.stride_w};
}

inline int64_t patch_row_offset(const Conv2dGeometry& c, int64_t channels, const WideLayout& w, int64_t row) {
  const PatchTap tap = patch_tap(c, channels, w, row);
  return tap.image * w.U * w.V + tap.shift;
}

// sum(x[0, n)) in float64, in 16 interleaved partial sums (vectorisable, no serial chain).
template <typename F>
__attribute__((always_inline)) inline double row_sum(const F* x, int64_t n) {
  constexpr int L = 16;
  double lanes[L] = {};
  int64_t t = 0;
  for (; t + L <= n; t += L)
    for (int l = 0; l < L; ++l) lanes[l] += x[t + l];
  double sum = 0.0;
  for (; t < n; ++t) sum += x[t];
  for (int l = 0; l < L; ++l) sum += lanes[l];
  return sum;
}

// g of one sample's group, (p, OH * OW), as (T wide, p_pad) rows (zero past OW and past p),
// the direct route's vector operand: W x W blocks transposed in registers where the compiler
// has the shuffles, else element by element.
template <typename F>
__attribute__((always_inline)) inline void wide_g_transposed(const F* g, const Conv2dGeometry& c, int64_t p,
                                                             int64_t p_pad, const WideLayout& w, F* out) {
  constexpr int W = kLanes<F>;
  const int64_t OW = c.out_width, T = c.out_height * OW;
  for (int64_t oy = 0; oy < c.out_height; ++oy)
    for (int64_t ox0 = 0; ox0 < w.V; ox0 += W) {
      const int64_t width = std::min<int64_t>(W, w.V - ox0);
      const int64_t valid = std::clamp<int64_t>(OW - ox0, 0, width);
      F* dst = out + (oy * w.V + ox0) * p_pad;
#ifdef LINEAR_NORMS_TRANSPOSE
      // Each row is read W positions at a time, past OW into the next row (masked to zero),
      // element by element where that would read past the group's g.
      using LaneIndex = std::conditional_t<sizeof(F) == 4, int32_t, int64_t>;
      typename VecOf<F>::index lane;
      for (int k = 0; k < W; ++k) lane[k] = k;
      const int64_t offset = oy * OW + ox0;
      for (int64_t j0 = 0; j0 < p; j0 += W) {
        Vec<F> v[W];
        for (int r = 0; r < W; ++r) {
          const int64_t j = j0 + r;
          v[r] = Vec<F>{};
          if (j >= p || valid == 0) continue;
          const F* src = g + j * T + offset;
          if (j * T + offset + W <= p * T)
            v[r] = load(src);
          else
            for (int64_t k = 0; k < valid; ++k) v[r][k] = src[k];
          if (valid < W) v[r] = lane < static_cast<LaneIndex>(valid) ? v[r] : Vec<F>{};
        }
        transpose_block<F>(v);
        for (int64_t ox = 0; ox < width; ++ox) store(dst + ox * p_pad + j0, v[ox]);
      }
#else
      for (int64_t j = 0; j < p; ++j) {
        const F* src = g + j * T + oy * OW + ox0;
        for (int64_t ox = 0; ox < valid; ++ox) dst[ox * p_pad + j] = src[ox];
      }
      for (int64_t ox = valid; ox < width; ++ox) std::fill(dst + ox * p_pad, dst + ox * p_pad + p, F(0));
#endif
    }
}

// g of one sample's group, (p, OH * OW), as (p, T wide) rows at steps of `row_step` >= T wide,
// zero past OW and past T wide.
template <typename F>
__attribute__((always_inline)) inline void wide_g_rows(const F* g, const Conv2dGeometry& c, int64_t p,
                                                       const WideLayout& w, int64_t row_step, F* out) {
  const int64_t OW = c.out_width, T = c.out_height * OW;
  for (int64_t j = 0; j < p; ++j) {
    F* dst = out + j * row_step;
    for (int64_t oy = 0; oy < c.out_height; ++oy) {
      std::copy(g + j * T + oy * OW, g + j * T + (oy + 1) * OW, dst + oy * w.V);
      std::fill(dst + oy * w.V + OW, dst + (oy + 1) * w.V, F(0));
    }
    std::fill(dst + w.T, dst + row_step, F(0));
  }
}

// One (sample, group)'s operands in the wide layout: the phase images; for the ghost route the
// patches `cols` (d, T wide) and g as (p, T wide) rows, for the direct route g as (T wide,
// p_pad) rows, in `gw`, zero past OW; and the per-sample bias gradients (sums of g's rows)
// where `bias` is not null.
template <typename F>
__attribute__((always_inline)) inline void wide_operands(const F* x, const F* g, const Conv2dGeometry& c,
                                                         int64_t cin, int64_t p, int64_t p_pad, bool ghost,
                                                         const WideLayout& w, const F* const* patch_rows, F* phases,
                                                         F* cols, F* gw, F* bias) {
  const int64_t OW = c.out_width, T = c.out_height * OW;
  phase_images(x, c, cin, w, phases);
  if (bias)
    for (int64_t j = 0; j < p; ++j) bias[j] = static_cast<F>(row_sum(g + j * T, T));
  if (!ghost) return wide_g_transposed(g, c, p, p_pad, w, gw);
  for (int64_t row = 0; row < cin * c.kernel_h * c.kernel_w; ++row)
    std::copy(patch_rows[row], patch_rows[row] + w.T, cols + row * w.T);
  wide_g_rows(g, c, p, w, w.T, gw);
}

FASTDP_MULTIVERSION void wide_operands_isa(const float* x, const float* g, const Conv2dGeometry& c, int64_t cin,
                                           int64_t p, int64_t p_pad, bool ghost, const WideLayout& w,
                                           const float* const* patch_rows, float* phases, float* cols, float* gw,
                                           float* bias) {
  wide_operands(x, g, c, cin, p, p_pad, ghost, w, patch_rows, phases, cols, gw, bias);
}

FASTDP_MULTIVERSION void wide_operands_isa(const double* x, const double* g, const Conv2dGeometry& c, int64_t cin,
                                           int64_t p, int64_t p_pad, bool ghost, const WideLayout& w,
                                           const double* const* patch_rows, double* phases, double* cols, double* gw,
                                           double* bias) {
  wide_operands(x, g, c, cin, p, p_pad, ghost, w, patch_rows, phases, cols, gw, bias);
}

// How the input gradient of one (sample, group) is laid out. The patch-row gradients dcols =
// W^T g (d, T wide) are written one row per `row_step`, after `lead` zeros and followed by
// zeros, in image order: row k of dcols is patch row rows[k], and rows[first[m] ..
// first[m + 1]) are those whose taps land in phase image m of dx. Each image then sums its
// rows, one vector at a time, each shifted by its tap's offset (shifts[k]). Reads at shifted
// offsets replace scattered adds: overlapping unaligned read-modify-writes of neighbouring
// taps would stall on store forwarding.
struct InputGradPlan {
  int64_t t_pad;     // T wide rounded up to whole vectors (g's rows are zero beyond T wide)
  int64_t lead;      // the largest shift of a tap within its image
  int64_t row_step;  // of dcols: lead + max(t_pad, U V rounded up to whole vectors)
  std::vector<int64_t> first, rows, shifts;
  InputGradPlan(const Conv2dGeometry& c, int64_t channels, const WideLayout& w, int64_t lanes)
      : first(w.images + 1, 0) {
    const int64_t d = channels * c.kernel_h * c.kernel_w, image_size = w.U * w.V;
    t_pad = (w.T + lanes - 1) / lanes * lanes;
    std::vector<PatchTap> taps(d);
    lead = 0;
    for (int64_t row = 0; row < d; ++row) {
      taps[row] = patch_tap(c, channels, w, row);
      lead = std::max(lead, taps[row].shift);
      ++first[taps[row].image + 1];
    }
    row_step = lead + std::max(t_pad, (image_size + lanes - 1) / lanes * lanes);
    for (int64_t m = 0; m < w.images; ++m) first[m + 1] += first[m];
    rows.resize(d);
    shifts.resize(d);
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (int64_t row = 0; row < d; ++row) {
      rows[next[taps[row].image]] = row;
      shifts[next[taps[row].image]++] = taps[row].shift;
    }
  }
  // Elements of the per-thread scratch: g rows, dcols (zeroed once: only [lead, lead + t_pad)
  // of each row is ever written) and the phase images of dx (one vector of slack: an image's
  // last vector runs into the next image, which is written after it).
  int64_t g_elements(int64_t p) const { return p * t_pad; }
  int64_t cols_elements(int64_t d) const { return d * row_step; }
  static int64_t image_elements(const WideLayout& w, int64_t lanes) { return w.images * w.U * w.V + lanes; }
};

// dx of one (sample, group), (cin, H, W), from its g and wt = the group's weight transposed
// (d, p): dcols = wt g in MR x 2W register tiles, the phase images gathered from dcols, then
// un-phased into dx.
template <typename F>
__attribute__((always_inline)) inline void input_grad(const F* g, const F* wt, const Conv2dGeometry& c,
                                                      int64_t cin, int64_t p, const WideLayout& w,
                                                      const InputGradPlan& plan, F* gin, F* dcols, F* images, F* dx) {
  constexpr int W = kLanes<F>;
  const int64_t d = cin * c.kernel_h * c.kernel_w, image_size = w.U * w.V, blocks = plan.t_pad / W;
  wide_g_rows(g, c, p, w, plan.t_pad, gin);
  auto gather = [&](int64_t m) {
    for (int64_t pos = 0; pos < image_size; pos += W) {
      Vec<F> sum = {};
      for (int64_t k = plan.first[m]; k < plan.first[m + 1]; ++k)
        sum += load(dcols + k * plan.row_step + plan.lead + pos - plan.shifts[k]);
      store(images + m * image_size + pos, sum);
    }
  };
  // dcols row k is patch row plan.rows[k] (sorted by image): each image is gathered as soon as
  // its rows are written, while they are in L1.
  int64_t image = 0;
  for (int64_t k0 = 0; k0 < d; k0 += MR) {
    const F* rows[MR];
    for (int r = 0; r < MR; ++r) rows[r] = wt + plan.rows[std::min<int64_t>(k0 + r, d - 1)] * p;
    for (int64_t cb = 0; cb < blocks; cb += 2) {
      const bool pair = cb + 1 < blocks;
      Vec<F> acc0[MR], acc1[MR];
      for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = Vec<F>{};
      if (pair)
        micro_kernel2(rows, 1, gin + cb * W, plan.t_pad, gin + (cb + 1) * W, plan.t_pad, p, acc0, acc1);
      else
        micro_kernel(rows, 1, gin + cb * W, plan.t_pad, p, acc0);
      F* out = dcols + k0 * plan.row_step + plan.lead + cb * W;
      for (int64_t r = 0; r < std::min<int64_t>(MR, d - k0); ++r) {
        store(out + r * plan.row_step, acc0[r]);
        if (pair) store(out + r * plan.row_step + W, acc1[r]);
      }
    }
    for (; image < w.images && plan.first[image + 1] <= std::min(d, k0 + MR); ++image) gather(image);
  }
  for (; image < w.images; ++image) gather(image);  // images no tap lands in: zeros
  unphase_images(images, c, cin, w, dx);
}

FASTDP_MULTIVERSION void input_grad_isa(const float* g, const float* wt, const Conv2dGeometry& c, int64_t cin,
                                        int64_t p, const WideLayout& w, const InputGradPlan& plan, float* gin,
                                        float* dcols, float* images, float* dx) {
  input_grad(g, wt, c, cin, p, w, plan, gin, dcols, images, dx);
}

FASTDP_MULTIVERSION void input_grad_isa(const double* g, const double* wt, const Conv2dGeometry& c, int64_t cin,
                                        int64_t p, const WideLayout& w, const InputGradPlan& plan, double* gin,
                                        double* dcols, double* images, double* dx) {
  input_grad(g, wt, c, cin, p, w, plan, gin, dcols, images, dx);
}

// Writes a direct tile (entry (j, k) of a^T g at tile[((j / MR) * col_blocks + k / W) * MR + j % MR]
// lane k % W, offsets from j0, k0) into out[j * p + k], rows of p: whole vectors where they fit.
template <typename F>
void store_direct_tile(const Vec<F>* tile, int64_t j0, int64_t j1, int64_t k0, int64_t k1, int64_t p, F* out) {
  constexpr int W = kLanes<F>;
  const int64_t col_blocks = (k1 - k0 + W - 1) / W;
  for (int64_t j = 0; j < j1 - j0; ++j) {
    F* dst = out + (j0 + j) * p + k0;
    for (int64_t c = 0; c < col_blocks; ++c) {
      const Vec<F>& v = tile[((j / MR) * col_blocks + c) * MR + j % MR];
      const int64_t width = std::min<int64_t>(W, k1 - k0 - c * W);
      if (width == W)
        store(dst + c * W, v);
      else
        for (int64_t k = 0; k < width; ++k) dst[c * W + k] = v[k];
    }
  }
}

}  // namespace

template <typename F>
void conv2d_sq_norms(const F* x, const F* g, const Conv2dGeometry& c, bool ghost, double* out, F* grads,
                     F* bias_grads, const F* weight, F* grad_input) {
  constexpr int W = kLanes<F>;
  const int64_t groups = c.groups, cin = c.channels / groups, p = c.out_channels / groups;
  const int64_t d = cin * c.kernel_h * c.kernel_w, OW = c.out_width, T = c.out_height * OW;
  const WideLayout wide(c, cin);
  const int64_t p_pad = (p + W - 1) / W * W;
  std::vector<double> partial(c.batch * groups);
  std::optional<InputGradPlan> plan;    // only where the input gradient is asked for
  std::vector<F> wt(grad_input ? groups * d * p : 0);  // each group's weight transposed, (d, p)
  if (grad_input) {
    plan.emplace(c, cin, wide, W);
    for (int64_t grp = 0; grp < groups; ++grp)
      for (int64_t j = 0; j < p; ++j)
        for (int64_t row = 0; row < d; ++row) wt[(grp * d + row) * p + j] = weight[(grp * p + j) * d + row];
  }
#pragma omp parallel
  {
    Scratch<F> phases(wide.phase_elements()), cols(ghost ? d * wide.T : 0), gw(wide.T * p_pad),
        pa(2 * TC * W);  // the direct route's packed vectors (the ghost route has its own scratch)
    Scratch<F> gin(plan ? plan->g_elements(p) : 0), dcols(plan ? plan->cols_elements(d) : 0),
        dx_images(plan ? InputGradPlan::image_elements(wide, W) : 0);
    if (plan) std::fill(dcols.get(), dcols.get() + plan->cols_elements(d), F(0));
    std::vector<const F*> patch_rows(d);  // the patch rows, in place in `phases`
    for (int64_t row = 0; row < d; ++row) patch_rows[row] = phases.get() + patch_row_offset(c, cin, wide, row);
    Scratch<Vec<F>> tile(TB * TB / W);  // the direct route's
    std::optional<GhostScratch> ghost_scratch;
    if (ghost) ghost_scratch.emplace(d, p);
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < c.batch * groups; ++item) {
      const int64_t i = item / groups, grp = item % groups;
      const F* gi = g + (i * c.out_channels + grp * p) * T;  // (p, OH * OW)
      F* gwi = gw.get();
      wide_operands_isa(x + (i * c.channels + grp * cin) * c.height * c.width, gi, c, cin, p, p_pad, ghost, wide,
                        patch_rows.data(), phases.get(), cols.get(), gwi,
                        bias_grads ? bias_grads + i * c.out_channels + grp * p : nullptr);
      double total = 0.0;
      if (ghost) {  // g as (p, T) wide rows
        for (int64_t t0 = 0; t0 < wide.T; t0 += TB) {
          const int64_t t1 = std::min(wide.T, t0 + TB);
          total += ghost_tile_isa(cols.get(), 1, wide.T, d, gwi, 1, wide.T, p, wide.T, t0, t1, *ghost_scratch);
        }
      } else {
        // ||g_i^T a_i||^2 = ||a_i^T g_i||^2: tiles over (d, p) with vectors along p, read from g
        // transposed to (T, p_pad) wide rows; the patch rows, broadcast, are read in place from
        // the phase images.
        for (int64_t j0 = 0; j0 < d; j0 += TB)
          for (int64_t k0 = 0; k0 < p; k0 += TB) {
            const int64_t j1 = std::min(d, j0 + TB), k1 = std::min(p, k0 + TB);
            total += direct_tile_isa(gwi, p_pad, 1, patch_rows.data() + j0, 1, wide.T, j0, j1, k0, k1, pa.get(),
                                     tile.get());
            if (grads) store_direct_tile(tile.get(), j0, j1, k0, k1, p, grads + (i * c.out_channels + grp * p) * d);
          }
      }
      partial[item] = total;
      if (plan)
        input_grad_isa(gi, wt.data() + grp * d * p, c, cin, p, wide, *plan, gin.get(), dcols.get(), dx_images.get(),
                       grad_input + (i * c.channels + grp * cin) * c.height * c.width);
    }
  }
  sum_partials(partial, c.batch, groups, out);
}

template void conv2d_sq_norms<float>(const float*, const float*, const Conv2dGeometry&, bool, double*, float*,
                                      float*, const float*, float*);
template void conv2d_sq_norms<double>(const double*, const double*, const Conv2dGeometry&, bool, double*,
                                        double*, double*, const double*, double*);

}  // namespace fastdp
