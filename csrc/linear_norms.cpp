// Tiled per-sample linear-layer gradient norms (see linear_norms.h).
//
// Both routes share one register-blocked micro-kernel: MR rows, each one 64-byte vector of
// W lanes (16 floats / 8 doubles) wide, accumulated over a reduction axis of length n from a
// packed panel (n vectors) and one broadcast scalar per row and step. Products are summed in
// the input dtype within a 64 x 64 tile and tiles are summed in float64.
#include "linear_norms.h"

#include <algorithm>
#include <memory>
#include <new>
#include <vector>

// The hot functions are compiled for AVX-512 and AVX2 besides the baseline ISA and picked
// at load time (GCC/Clang function multi-versioning on x86-64 ELF): wide vectors where the
// CPU has them, never required. Local twin of simd.h's FASTDP_MULTIVERSION, which that
// header's owner is replacing.
#if defined(__x86_64__) && defined(__ELF__) && (defined(__GNUC__) || defined(__clang__))
#define LINEAR_NORMS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LINEAR_NORMS_CLONES
#endif

namespace fastdp {
namespace {

constexpr int MR = 8;         // rows of a micro-tile (broadcast operand)
constexpr int64_t TB = 64;    // tile edge on T (ghost) and on p and d (direct); multiple of MR and W
constexpr int64_t TC = 256;   // direct: rows of T packed per chunk

// A 64-byte vector, lowered by GCC/Clang to the clone's ISA (one zmm, two ymm or four xmm),
// and the same vector at any element-aligned address (for loads from packed panels).
template <typename F>
struct VecOf {
  typedef F type __attribute__((vector_size(64)));
  typedef F unaligned __attribute__((vector_size(64), aligned(sizeof(F)), may_alias));
};
template <typename F>
using Vec = typename VecOf<F>::type;
template <typename F>
constexpr int kLanes = 64 / sizeof(F);

template <typename F>
__attribute__((always_inline)) inline const typename VecOf<F>::unaligned& load(const F* p) {
  return *reinterpret_cast<const typename VecOf<F>::unaligned*>(p);
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

// acc[r] += sum_{k < n} panel[k] * rows[r][k * step]: panel holds n vectors of W lanes.
template <typename F>
__attribute__((always_inline)) inline void micro_kernel(const F* const* rows, int64_t step, const F* panel,
                                                        int64_t n, Vec<F>* acc) {
  constexpr int W = kLanes<F>;
  Vec<F> c[MR];
  for (int r = 0; r < MR; ++r) c[r] = acc[r];
  const F* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = rows[r];
  for (int64_t k = 0; k < n; ++k) {
    const Vec<F> col = load(panel + k * W);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      c[r] += col * x[r][0];
      x[r] += step;
    }
  }
  for (int r = 0; r < MR; ++r) acc[r] = c[r];
}

// Ghost panel of rows [t0, t1) of one sample's (T, K) matrix x, transposed in blocks of W rows:
// panel[(c * K + k) * W + j] = x[t0 + c W + j, k], zero past t1.
template <typename F>
void pack_rows_transposed(const F* x, int64_t st, int64_t sk, int64_t K, int64_t t0, int64_t t1, F* panel) {
  constexpr int W = kLanes<F>;
  const int64_t blocks = (t1 - t0 + W - 1) / W;
  std::fill(panel, panel + blocks * K * W, F(0));
  for (int64_t t = t0; t < t1; ++t) {
    F* dst = panel + ((t - t0) / W) * K * W + (t - t0) % W;
    const F* src = x + t * st;
    for (int64_t k = 0; k < K; ++k) dst[k * W] = src[k * sk];
  }
}

// Ghost work item: column tile [t0, t1) of sample (a, g) (rows of length d and p). Returns
// sum over s < t1, t in the tile of w(s, t) (a_s . a_t)(g_s . g_t) with w = 2 above the
// diagonal, 1 on it, 0 below, so that the tiles of one sample add up to the full sum.
template <typename F>
__attribute__((always_inline)) inline double ghost_tile(const F* a, int64_t sat, int64_t sad, int64_t d,
                                                        const F* g, int64_t sgt, int64_t sgp, int64_t p,
                                                        int64_t seq, int64_t t0, int64_t t1, F* pa, F* pg) {
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
    Vec<F> tile_sum = {};
    for (int64_t r0 = s0; r0 < std::min(s0 + TB, t1); r0 += MR) {
      const F* ra[MR];
      const F* rg[MR];
      for (int r = 0; r < MR; ++r) {  // rows past T repeat row T-1 and get weight 0
        const int64_t s = std::min(r0 + r, seq - 1);
        ra[r] = a + s * sat;
        rg[r] = g + s * sgt;
      }
      for (int64_t c = 0; c < blocks; ++c) {
        const int64_t c0 = t0 + c * W;
        if (r0 >= c0 + W) continue;  // entirely below the diagonal
        Vec<F> ga[MR] = {}, gg[MR] = {};
        micro_kernel(ra, sad, pa + c * d * W, d, ga);
        micro_kernel(rg, sgp, pg + c * p * W, p, gg);
        if (r0 + MR <= c0) {  // entirely above the diagonal
          Vec<F> sum = {};
          for (int r = 0; r < MR; ++r) sum += ga[r] * gg[r];
          tile_sum += sum + sum;
        } else {
          for (int r = 0; r < MR; ++r) tile_sum += ga[r] * gg[r] * load(weight + OFF + c0 - (r0 + r));
        }
      }
    }
    total += lane_sum<F>(tile_sum);
  }
  return total;
}

LINEAR_NORMS_CLONES double ghost_tile_f32(const float* a, int64_t sat, int64_t sad, int64_t d, const float* g,
                                          int64_t sgt, int64_t sgp, int64_t p, int64_t seq, int64_t t0, int64_t t1,
                                          float* pa, float* pg) {
  return ghost_tile(a, sat, sad, d, g, sgt, sgp, p, seq, t0, t1, pa, pg);
}

LINEAR_NORMS_CLONES double ghost_tile_f64(const double* a, int64_t sat, int64_t sad, int64_t d, const double* g,
                                          int64_t sgt, int64_t sgp, int64_t p, int64_t seq, int64_t t0, int64_t t1,
                                          double* pa, double* pg) {
  return ghost_tile(a, sat, sad, d, g, sgt, sgp, p, seq, t0, t1, pa, pg);
}

// Direct work item: the (j0..j1) x (k0..k1) tile of g^T a for one sample, accumulated over T
// in chunks of TC rows, then square-summed. Chunk panels: pa[(c * n + t) * W + j] =
// a[t, k0 + c W + j] and pg[(b * n + t) * MR + r] = g[t, j0 + b MR + r], zero past d and p.
template <typename F>
__attribute__((always_inline)) inline double direct_tile(const F* a, int64_t sat, int64_t sad, const F* g,
                                                         int64_t sgt, int64_t sgp, int64_t seq, int64_t j0,
                                                         int64_t j1, int64_t k0, int64_t k1, F* pa, F* pg,
                                                         Vec<F>* tile) {
  constexpr int W = kLanes<F>;
  const int64_t row_blocks = (j1 - j0 + MR - 1) / MR, col_blocks = (k1 - k0 + W - 1) / W;
  std::fill(tile, tile + row_blocks * col_blocks * MR, Vec<F>{});
  for (int64_t t0 = 0; t0 < seq; t0 += TC) {
    const int64_t n = std::min(TC, seq - t0);
    std::fill(pa, pa + col_blocks * n * W, F(0));
    std::fill(pg, pg + row_blocks * n * MR, F(0));
    for (int64_t t = 0; t < n; ++t) {
      const F* at = a + (t0 + t) * sat;
      const F* gt = g + (t0 + t) * sgt;
      for (int64_t k = k0; k < k1; ++k) pa[(((k - k0) / W) * n + t) * W + (k - k0) % W] = at[k * sad];
      for (int64_t j = j0; j < j1; ++j) pg[(((j - j0) / MR) * n + t) * MR + (j - j0) % MR] = gt[j * sgp];
    }
    for (int64_t b = 0; b < row_blocks; ++b) {
      const F* rows[MR];
      for (int r = 0; r < MR; ++r) rows[r] = pg + b * n * MR + r;
      for (int64_t c = 0; c < col_blocks; ++c) micro_kernel(rows, MR, pa + c * n * W, n, tile + (b * col_blocks + c) * MR);
    }
  }
  Vec<F> sum = {};
  for (int64_t v = 0; v < row_blocks * col_blocks * MR; ++v) sum += tile[v] * tile[v];
  return lane_sum<F>(sum);
}

LINEAR_NORMS_CLONES double direct_tile_f32(const float* a, int64_t sat, int64_t sad, const float* g, int64_t sgt,
                                           int64_t sgp, int64_t seq, int64_t j0, int64_t j1, int64_t k0, int64_t k1,
                                           float* pa, float* pg, Vec<float>* tile) {
  return direct_tile(a, sat, sad, g, sgt, sgp, seq, j0, j1, k0, k1, pa, pg, tile);
}

LINEAR_NORMS_CLONES double direct_tile_f64(const double* a, int64_t sat, int64_t sad, const double* g, int64_t sgt,
                                           int64_t sgp, int64_t seq, int64_t j0, int64_t j1, int64_t k0, int64_t k1,
                                           double* pa, double* pg, Vec<double>* tile) {
  return direct_tile(a, sat, sad, g, sgt, sgp, seq, j0, j1, k0, k1, pa, pg, tile);
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
    Scratch<F> pa(TB * a.dim), pg(TB * g.dim);
    // Items (sample, column tile); tile u costs ~u + 1 row tiles, hence dynamic scheduling.
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < batch * tiles; ++item) {
      const int64_t i = item / tiles, t0 = (item % tiles) * TB, t1 = std::min(seq, t0 + TB);
      const F* ai = a.data + i * a.sb;
      const F* gi = g.data + i * g.sb;
      if constexpr (sizeof(F) == 4)
        partial[item] = ghost_tile_f32(ai, a.st, a.sk, a.dim, gi, g.st, g.sk, g.dim, seq, t0, t1, pa.get(), pg.get());
      else
        partial[item] = ghost_tile_f64(ai, a.st, a.sk, a.dim, gi, g.st, g.sk, g.dim, seq, t0, t1, pa.get(), pg.get());
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
    Scratch<F> pa(TC * TB), pg(TC * TB);
    Scratch<Vec<F>> tile(TB * TB / kLanes<F>);
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < batch * tiles; ++item) {
      const int64_t i = item / tiles, j0 = (item % tiles) / d_tiles * TB, k0 = (item % d_tiles) * TB;
      const int64_t j1 = std::min(g.dim, j0 + TB), k1 = std::min(a.dim, k0 + TB);
      const F* ai = a.data + i * a.sb;
      const F* gi = g.data + i * g.sb;
      if constexpr (sizeof(F) == 4)
        partial[item] = direct_tile_f32(ai, a.st, a.sk, gi, g.st, g.sk, seq, j0, j1, k0, k1, pa.get(), pg.get(),
                                        tile.get());
      else
        partial[item] = direct_tile_f64(ai, a.st, a.sk, gi, g.st, g.sk, seq, j0, j1, k0, k1, pa.get(), pg.get(),
                                        tile.get());
    }
  }
  sum_partials(partial, batch, tiles, out);
}

template void linear_sq_norms_ghost<float>(const Strided3<float>&, const Strided3<float>&, double*);
template void linear_sq_norms_ghost<double>(const Strided3<double>&, const Strided3<double>&, double*);
template void linear_sq_norms_direct<float>(const Strided3<float>&, const Strided3<float>&, double*);
template void linear_sq_norms_direct<double>(const Strided3<double>&, const Strided3<double>&, double*);

}  // namespace fastdp
