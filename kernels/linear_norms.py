"""Per-sample squared weight-gradient norms of a linear layer, tiled (Triton).

``a``: ``(B, T, d)`` activations, ``g``: ``(B, T, p)`` output gradients; results are
float64 ``(B,)``. References: :func:`fastdp.ops.linear_sq_norms_ghost_ref` and
:func:`fastdp.ops.linear_sq_norms_direct_ref`.

* ghost: ``sum_{s,t} (a_s.a_t)(g_s.g_t)``; program ``(i, k)`` takes the k-th tile pair
  ``(S, U)``, ``U >= S``, of the T axis, computes the Gram tiles of ``a_i`` and ``g_i`` with
  ``tl.dot``, multiplies them and reduces at once (off-diagonal pairs count twice), so no
  ``T x T`` Gram is stored and every program does the same work.
* direct: program ``(i, P)`` accumulates the tile ``g_i[:, P]^T a_i[:, D]`` over T for each
  column tile D and adds its squared entries, so no ``(p, d)`` per-sample gradient is stored.

Both write one partial sum per program (extra memory ``B`` times the tile pairs of T, or
the tiles of p), summed in float64 afterwards. The ghost kernel forms its Gram tiles in
float64 whatever the input dtype: its sum can cancel to far less than its terms, and Grams
rounded in float32 let such a sample's norm come out near zero, so that it escaped
clipping. The direct kernel sums squares (no cancellation): its tile products are summed in
float32 with IEEE products (float64 inputs stay float64; bfloat16/float16 inputs are
multiplied in their dtype with float32 accumulation); each tile is then squared and summed in
float64 (a float32 square overflows past 1.8e19, and a finite sample would lose its norm).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.reductions import block_sum

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _gram_tile(x, rows_s, rows_t, n_rows, n_cols, stride_t, stride_k,
               BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``x[rows_s] @ x[rows_t]^T`` for one sample, rows and columns past the edge read as 0
    (``rows_*`` int64: offsets are formed in 64 bits)."""
    acc = tl.full((BLOCK_T, BLOCK_T), 0, ACC)
    for k0 in range(0, n_cols, BLOCK_K):
        cols = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        col_ok = cols[None, :] < n_cols
        xs = tl.load(x + rows_s[:, None] * stride_t + cols[None, :] * stride_k,
                     mask=(rows_s[:, None] < n_rows) & col_ok, other=0.0)
        xt = tl.load(x + rows_t[:, None] * stride_t + cols[None, :] * stride_k,
                     mask=(rows_t[:, None] < n_rows) & col_ok, other=0.0)
        acc += tl.dot(xs.to(ACC) if UPCAST else xs, tl.trans(xt.to(ACC) if UPCAST else xt),
                      input_precision=PRECISION, out_dtype=ACC)
    return acc


@triton.jit
def _ghost_kernel(a, g, pair_s, pair_t, n_pairs, partial, T, D, P, sab, sat, sad, sgb, sgt, sgp,
                  BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # program (sample i, tile pair) on a 1-D grid (a second grid axis is limited to 65535 on CUDA);
    # indices in int64, as i * stride may pass 2^31 elements
    pid = tl.program_id(0)
    i = (pid // n_pairs).to(tl.int64)
    pair = pid % n_pairs
    tile_s = tl.load(pair_s + pair)
    tile_t = tl.load(pair_t + pair)
    rows_s = (tile_s * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    rows_t = (tile_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    gram_a = _gram_tile(a + i * sab, rows_s, rows_t, T, D, sat, sad, BLOCK_T, BLOCK_K, ACC, PRECISION, UPCAST)
    gram_g = _gram_tile(g + i * sgb, rows_s, rows_t, T, P, sgt, sgp, BLOCK_T, BLOCK_K, ACC, PRECISION, UPCAST)
    weight = tl.where(tile_t > tile_s, 2.0, 1.0)
    total = weight * block_sum(gram_a * gram_g).to(tl.float64)
    tl.store(partial + pid + tl.arange(0, 1), total + tl.full((1,), 0, tl.float64))


@triton.jit
def _direct_kernel(a, g, partial, T, D, P, sab, sat, sad, sgb, sgt, sgp,
                   BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                   ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # int64 indices: i * stride past 2^31 elements must not wrap
    tile_p = tl.program_id(1)
    rows_p = (tile_p * BLOCK_P + tl.arange(0, BLOCK_P)).to(tl.int64)
    total = tl.full((1,), 0, tl.float64)
    for d0 in range(0, D, BLOCK_D):
        cols_d = (d0 + tl.arange(0, BLOCK_D)).to(tl.int64)
        tile = tl.full((BLOCK_P, BLOCK_D), 0, ACC)
        for t0 in range(0, T, BLOCK_T):
            ts = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
            gt = tl.load(g + i * sgb + ts[:, None] * sgt + rows_p[None, :] * sgp,
                         mask=(ts[:, None] < T) & (rows_p[None, :] < P), other=0.0)
            at = tl.load(a + i * sab + ts[:, None] * sat + cols_d[None, :] * sad,
                         mask=(ts[:, None] < T) & (cols_d[None, :] < D), other=0.0)
            tile += tl.dot(tl.trans(gt.to(ACC) if UPCAST else gt), at.to(ACC) if UPCAST else at,
                           input_precision=PRECISION, out_dtype=ACC)
        valid = (rows_p[:, None] < P) & (cols_d[None, :] < D)
        tile = tl.where(valid, tile, 0.0).to(tl.float64)  # squared in float64: no overflow past 1.8e19
        total += block_sum(tile * tile)
    tl.store(partial + i * tl.num_programs(1) + tile_p + tl.arange(0, 1), total)


def _dot_config(dtype: torch.dtype) -> dict:
    """Accumulator dtype and ``tl.dot`` precision of the direct kernel for an input dtype:
    float32 with exact ("ieee") products. Half-precision tiles are upcast before ``tl.dot``
    only under TRITON_INTERPRET=1, whose bfloat16 dot is wrong (the products are exact in
    float32 either way)."""
    if dtype == torch.float64:
        return dict(ACC=tl.float64, PRECISION="ieee", UPCAST=False)
    half = dtype in (torch.bfloat16, torch.float16)
    return dict(ACC=tl.float32, PRECISION=None if half else "ieee", UPCAST=half and _INTERPRETED)


# The ghost kernel's Gram tiles: float64 products of the upcast inputs (exact for float32 and
# half precision) and float64 sums.
_GHOST_DOT = dict(ACC=tl.float64, PRECISION="ieee", UPCAST=True)


def _block(n: int, cap: int) -> int:
    """Power-of-two tile edge for an extent ``n``: at least 16 (``tl.dot``), at most ``cap``."""
    return max(16, min(cap, triton.next_power_of_2(max(n, 1))))


_PAIRS: dict = {}


def _tile_pairs(n_tiles: int, device: torch.device):
    """Upper-triangular tile pairs ``(S, U)``, ``U >= S``, as two int32 tensors (cached)."""
    key = (n_tiles, str(device))
    if key not in _PAIRS:
        s, t = torch.triu_indices(n_tiles, n_tiles)
        _PAIRS[key] = (s.to(device, torch.int32), t.to(device, torch.int32))
    return _PAIRS[key]


def linear_sq_norms_ghost_triton(a: torch.Tensor, g: torch.Tensor, block_t: int = 64, block_k: int = 32,
                                 num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Tiled ghost norm in float64, float64 ``(B,)``; see the module docstring. The default
    tiles are the float64 ones picked on an H100 (bench/gpu-h100/, when the kernel took
    float32 Grams for float32 inputs); float64 Grams from float32 inputs are unmeasured there."""
    batch, seq, d = a.shape
    p = g.shape[-1]
    if batch == 0 or seq == 0:
        return torch.zeros(batch, dtype=torch.float64, device=a.device)
    block_t = _block(seq, block_t)
    block_k = _block(max(d, p), block_k)
    pair_s, pair_t = _tile_pairs(triton.cdiv(seq, block_t), a.device)
    partial = torch.empty(batch, pair_s.numel(), dtype=torch.float64, device=a.device)  # every entry is stored
    _ghost_kernel[(batch * pair_s.numel(),)](
        a, g, pair_s, pair_t, pair_s.numel(), partial, seq, d, p, *a.stride(), *g.stride(),
        BLOCK_T=block_t, BLOCK_K=block_k, **_GHOST_DOT,
        num_warps=num_warps, num_stages=num_stages,
    )
    return partial.sum(1)


def linear_sq_norms_direct_triton(
    a: torch.Tensor, g: torch.Tensor, block_p: int = 64, block_d: int = 64, block_t: int = 32
) -> torch.Tensor:
    """Tiled per-sample-gradient norm, float64 ``(B,)``; see the module docstring."""
    batch, seq, d = a.shape
    p = g.shape[-1]
    if batch == 0 or seq == 0:
        return torch.zeros(batch, dtype=torch.float64, device=a.device)
    if a.dtype != g.dtype:  # tl.dot takes one dtype
        dtype = torch.promote_types(a.dtype, g.dtype)
        a, g = a.to(dtype), g.to(dtype)
    block_p, block_d, block_t = _block(p, block_p), _block(d, block_d), _block(seq, block_t)
    n_tiles = triton.cdiv(p, block_p)
    partial = torch.empty(batch, n_tiles, dtype=torch.float64, device=a.device)  # every entry is stored
    _direct_kernel[(batch, n_tiles)](
        a, g, partial, seq, d, p, *a.stride(), *g.stride(),
        BLOCK_P=block_p, BLOCK_D=block_d, BLOCK_T=block_t, **_dot_config(a.dtype),
    )
    return partial.sum(1)
