"""Fused DP noise ``out = (s + std * z) / divisor`` with counter-based normals.

The noise stream (shared with ``csrc/philox.h``, which documents it in full): element
``e`` of the ``k``-th tensor of a call draws from Philox4x32-10 keyed by the 64-bit
seed, at counter ``(c_lo, c_hi, k, 0)`` with ``c = (e // 4G) * G + e % G``, output word
``(e % 4G) // G`` (``G = GROUP``), turned into normals by Box-Muller on word pairs.
``philox_normal_ref`` is the pure-PyTorch definition; the C++, CUDA and Triton kernels
reproduce it up to float32 rounding (FMA contraction). The normals are float32, so these
take float32 and half-precision sums only: a float64 sum's low bits would show through
noise on float32's grid (``fastdp.ops.noisy_average`` gives float64 sums float64 normals).
"""
from __future__ import annotations

import math
from typing import List, Sequence

import torch
import triton
import triton.language as tl

from fastdp import ops

GROUP = 256
_MASK32 = 0xFFFFFFFF
_PHILOX_MUL = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY_STEP = (0x9E3779B9, 0xBB67AE85)
_TURN = (math.pi / 2) / 2**30


# --------------------------------------------------------------------------- reference


def _mul_hi_lo(a: torch.Tensor, m: int):
    """High and low 32-bit words of ``a * m`` for ``a`` in int64 holding uint32 values."""
    lo_part, hi_part = a * (m & 0xFFFF), a * (m >> 16)  # both < 2^48
    lo = ((hi_part & 0xFFFF) << 16) + lo_part
    hi = (hi_part + (lo_part >> 16)) >> 16
    return hi & _MASK32, lo & _MASK32


def philox4x32_10_ref(c: List[torch.Tensor], k0: int, k1: int) -> List[torch.Tensor]:
    """Philox4x32-10 on int64 tensors holding uint32 words (counter ``c``, key ``(k0, k1)``)."""
    c0, c1, c2, c3 = c
    for _ in range(10):
        hi0, lo0 = _mul_hi_lo(c0, _PHILOX_MUL[0])
        hi1, lo1 = _mul_hi_lo(c2, _PHILOX_MUL[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_KEY_STEP[0]) & _MASK32, (k1 + _PHILOX_KEY_STEP[1]) & _MASK32
    return [c0, c1, c2, c3]


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def box_muller_ref(w_radius: torch.Tensor, w_angle: torch.Tensor):
    """Two float32 normals from two uint32 words (int64 tensors), as in ``philox.h``: the radius
    from a 39-bit uniform (w_radius's top 31 bits, w_angle's low 8), the angle from w_angle's
    top 24 bits."""
    fine = ((w_angle & 0xFF) + 1).to(torch.float32) * _f32(2.0**-8)
    u = ((w_radius >> 1).to(torch.float32) + fine) * _f32(2.0**-31)
    bits = u.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    big = (bits & 0x7FFFFF) > 0x3504F3
    m = ((bits & 0x7FFFFF) | torch.where(big, 0x3F000000, 0x3F800000)).to(torch.int32).view(torch.float32)
    e = (e + big.to(torch.int32)).to(torch.float32)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    series = s2 * (1 / 3 + s2 * (1 / 5 + s2 * (1 / 7 + s2 * (1 / 9))))
    r = torch.sqrt(-2.0 * (e * _f32(math.log(2.0)) + (2.0 * s + 2.0 * s * series)))
    turn = w_angle & 0xFFFFFF00
    quadrant = ((turn + 0x20000000) & _MASK32) >> 30
    rest = turn - (quadrant << 30)
    rest = torch.where(rest >= 2**31, rest - 2**32, rest)
    phi = rest.to(torch.float32) * _f32(_TURN)
    p2 = phi * phi
    sn = phi * (1.0 + p2 * (-1 / 6 + p2 * (1 / 120 + p2 * (-1 / 5040 + p2 * (1 / 362880)))))
    cs = 1.0 + p2 * (-0.5 + p2 * (1 / 24 + p2 * (-1 / 720 + p2 * (1 / 40320 + p2 * (-1 / 3628800)))))
    swap = (quadrant & 1) == 1
    c_abs, s_abs = torch.where(swap, sn, cs), torch.where(swap, cs, sn)
    cos = torch.where(((quadrant + 1) & 2) != 0, -c_abs, c_abs)
    sin = torch.where((quadrant & 2) != 0, -s_abs, s_abs)
    return r * cos, r * sin


def philox_normal_ref(numel: int, seed: int, index: int) -> torch.Tensor:
    """The first ``numel`` float32 normals of stream ``index`` under ``seed`` (CPU)."""
    groups = -(-numel // (4 * GROUP))
    counter = torch.arange(groups * GROUP, dtype=torch.int64)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    zero = torch.zeros_like(counter)
    w = philox4x32_10_ref([counter & _MASK32, counter >> 32, zero + index, zero], k0, k1)
    z0, z1 = box_muller_ref(w[0], w[1])
    z2, z3 = box_muller_ref(w[2], w[3])
    lanes = torch.stack([z.view(groups, GROUP) for z in (z0, z1, z2, z3)], dim=1)
    return lanes.reshape(-1)[:numel]


def noisy_average_philox_ref(
    sums: Sequence[torch.Tensor], std: float, divisor: float, seed: int
) -> List[torch.Tensor]:
    """``(s + std * z) / divisor`` with the kernels' Philox stream (``z`` of tensor k = stream k), in float32."""
    ops.check_float32_sums(sums)
    out = []
    for k, s in enumerate(sums):
        z = philox_normal_ref(s.numel(), seed, k).to(device=s.device).view(s.shape)
        out.append(((s.to(torch.float32) + std * z) / divisor).to(s.dtype))
    return out


# --------------------------------------------------------------------------- Triton


@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    """Triton twin of ``philox4x32_10_ref`` on uint32 tensors (key words uint32 scalars)."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo0 = c0 * 0xD2511F53
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 += 0x9E3779B9
        k1 += 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _box_muller(w_radius, w_angle):
    """Triton twin of ``box_muller_ref`` (uint32 words in, two float32 normals out)."""
    fine = ((w_angle & 0xFF) + 1).to(tl.int32).to(tl.float32) * 0.00390625
    u = ((w_radius >> 1).to(tl.int32).to(tl.float32) + fine) * 4.656612873077392578125e-10
    bits = u.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    big = (bits & 0x7FFFFF) > 0x3504F3
    m = ((bits & 0x7FFFFF) | tl.where(big, 0x3F000000, 0x3F800000)).to(tl.float32, bitcast=True)
    e = (e + big.to(tl.int32)).to(tl.float32)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    series = s2 * (1 / 3 + s2 * (1 / 5 + s2 * (1 / 7 + s2 * (1 / 9))))
    r = tl.sqrt(-2.0 * (e * 0.693147180559945 + (2.0 * s + 2.0 * s * series)))
    turn = w_angle & 0xFFFFFF00
    quadrant = (turn + 0x20000000) >> 30
    phi = (turn - (quadrant << 30)).to(tl.int32, bitcast=True).to(tl.float32) * 1.4629180792671596e-09
    p2 = phi * phi
    sn = phi * (1.0 + p2 * (-1 / 6 + p2 * (1 / 120 + p2 * (-1 / 5040 + p2 * (1 / 362880)))))
    cs = 1.0 + p2 * (-0.5 + p2 * (1 / 24 + p2 * (-1 / 720 + p2 * (1 / 40320 + p2 * (-1 / 3628800)))))
    swap = (quadrant & 1) == 1
    c_abs = tl.where(swap, sn, cs)
    s_abs = tl.where(swap, cs, sn)
    cos = tl.where(((quadrant + 1) & 2) != 0, -c_abs, c_abs)
    sin = tl.where((quadrant & 2) != 0, -s_abs, s_abs)
    return r * cos, r * sin


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _noisy_average_kernel(
    like, src_ptrs, dst_ptrs, numels, indices, prog_tensor, prog_group, seed_lo, seed_hi, std, divisor,
    GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
):
    """One program: GROUPS_PER_PROG groups of 4*GROUP elements of tensor prog_tensor[pid]."""
    pid = tl.program_id(0)
    t = tl.load(prog_tensor + pid)
    ptr_ty = tl.pointer_type(like.dtype.element_ty)
    src = tl.load(src_ptrs + t).to(ptr_ty)
    dst = tl.load(dst_ptrs + t).to(ptr_ty)
    n = tl.load(numels + t)
    group = tl.load(prog_group + pid) + tl.arange(0, GROUPS_PER_PROG)[:, None]
    counter = group * GROUP + tl.arange(0, GROUP)[None, :]
    c0 = (counter & 0xFFFFFFFF).to(tl.uint32)
    c1 = (counter >> 32).to(tl.uint32)
    c2 = c0 * 0 + tl.load(indices + t).to(tl.uint32)
    w0, w1, w2, w3 = _philox(c0, c1, c2, c0 * 0, seed_lo.to(tl.uint32), seed_hi.to(tl.uint32))
    z0, z1 = _box_muller(w0, w1)
    z2, z3 = _box_muller(w2, w3)
    base = group * (4 * GROUP) + tl.arange(0, GROUP)[None, :]
    _store_noisy(src, dst, base, n, z0, std, divisor)
    _store_noisy(src, dst, base + GROUP, n, z1, std, divisor)
    _store_noisy(src, dst, base + 2 * GROUP, n, z2, std, divisor)
    _store_noisy(src, dst, base + 3 * GROUP, n, z3, std, divisor)


@triton.jit
def _store_noisy(src, dst, offs, n, z, std, divisor):
    """dst[offs] = (src[offs] + std * z) / divisor where offs < n, in float32."""
    mask = offs < n
    s = tl.load(src + offs, mask=mask, other=0.0)
    tl.store(dst + offs, ((s.to(tl.float32) + std * z) / divisor).to(s.dtype), mask=mask)


def noisy_average_triton(
    sums: Sequence[torch.Tensor], std: float, divisor: float, seed: int, inplace: bool = False,
    groups_per_prog: int = 4, num_warps: int = 4,
) -> List[torch.Tensor]:
    """Multi-tensor fused noise: one launch per dtype for all tensors of ``sums`` (float32 or half;
    float64 refused); each program draws ``groups_per_prog`` groups (4 * GROUP elements each)
    with ``num_warps`` warps."""
    ops.check_float32_sums(sums)
    srcs = [s.contiguous() for s in sums]
    outs = srcs if inplace else [torch.empty_like(s) for s in srcs]
    by_dtype = {}
    for k, s in enumerate(srcs):
        if s.numel():
            by_dtype.setdefault(s.dtype, []).append(k)
    per_prog = 4 * GROUP * groups_per_prog
    for members in by_dtype.values():
        device = srcs[members[0]].device
        # Both tables are built on the host and sent in one copy each (no device-side
        # repeat_interleave, whose output size would need a host sync).
        tensors = torch.tensor([[srcs[k].data_ptr() for k in members], [outs[k].data_ptr() for k in members],
                                [srcs[k].numel() for k in members], members], dtype=torch.int64)
        progs = -(-tensors[2] // per_prog)
        prog_tensor = torch.repeat_interleave(torch.arange(len(members)), progs)
        first = torch.cumsum(progs, 0) - progs
        prog_group = (torch.arange(prog_tensor.numel()) - first[prog_tensor]) * groups_per_prog
        # non_blocking from pageable memory: staged before returning, and no stream sync
        tensors = tensors.to(device, non_blocking=True)
        programs = torch.stack([prog_tensor, prog_group]).to(device, non_blocking=True)
        _noisy_average_kernel[(programs.shape[1],)](
            srcs[members[0]], tensors[0], tensors[1], tensors[2], tensors[3], programs[0], programs[1],
            seed & _MASK32, (seed >> 32) & _MASK32, float(std), float(divisor),
            GROUP=GROUP, GROUPS_PER_PROG=groups_per_prog, num_warps=num_warps,
        )
    return outs
