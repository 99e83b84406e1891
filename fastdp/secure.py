"""Secure mode: randomness from OS entropy, and noise hardened against floating-point attacks.

Threat: a floating-point Gaussian (or Laplace) sampler does not produce every float near
``s + noise``; the set of values it can output depends on ``s``, so one released value
can reveal which neighbouring dataset produced it (Mironov 2012 for Laplace; Jin et al.
2022 for the Gaussian samplers of DP libraries). Seeded noise is also replayable by
anyone who learns the seed, or who can search the seeds: torch's CPU generator
(mt19937) keeps only the low 32 bits of its seed, so noise drawn from it after a 64-bit
seed has only 2^32 possible values per step, few enough to try them all against one
released gradient and subtract the noise exactly.

What :func:`secure_noisy_average` does, per step:

1. every standard normal comes straight from ``os.urandom`` (no seeded generator): two
   64-bit words give two normals by Box-Muller in float64, on uniforms of 53 bits, so
   ``|z| <= sqrt(106 ln 2) ~ 8.57`` (:func:`os_normals`);
2. every coordinate of the noise is ``(z1 + z2) / sqrt(2)`` with ``z1, z2`` independent
   standard normals (from different draws): exactly N(0, 1), and the sum of two draws
   fills the gaps left in the output set of a single draw (the mitigation Holohan &
   Braghin 2021 measured; Opacus' secure mode sums several draws for the same reason);
3. noise and sum are combined in float64 and the result is rounded once to the
   parameter's dtype. For float32/bf16 parameters this final rounding snaps the released
   value to a grid 2^29 (or more) times coarser than the float64 noise's resolution, so
   every grid point near ``s`` is reachable whatever ``s`` is (the idea of Mironov's
   snapping mechanism). For float64 parameters step 3 adds nothing. (Data parallel:
   rank 0 rounds its noisy sum before the all-reduce adds the other ranks' sums.)

This is a mitigation, not a proof of exact DP in floating point. It reads 16 bytes of OS
entropy per coordinate and step, which costs about as much as drawing the two float64
normals from torch's generator did (a few times the default noise generation).
"""
from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence

import torch

_CHUNK = 1 << 20  # normals per read from the OS (8 MiB of entropy)
_TOP53 = (1 << 53) - 1


def os_entropy(bits: int = 256) -> int:
    """A non-negative integer of ``bits`` random bits from the OS CSPRNG (``os.urandom``)."""
    return int.from_bytes(os.urandom((bits + 7) // 8), "little") >> (-bits % 8)


def os_normals(n: int) -> torch.Tensor:
    """``n`` independent standard normals, float64 on the CPU, from OS entropy: per pair, two
    64-bit words give ``u`` in (0, 1] and an angle, each of 53 bits, and Box-Muller gives
    ``sqrt(-2 ln u) (cos, sin)``."""
    parts = []
    for start in range(0, n, _CHUNK):
        count = min(_CHUNK, n - start)
        pairs = (count + 1) // 2
        words = torch.frombuffer(bytearray(os.urandom(16 * pairs)), dtype=torch.int64).view(2, pairs)
        top = (words >> 11) & _TOP53  # the top 53 bits of each word (>> is arithmetic: masked)
        radius = torch.sqrt(-2.0 * torch.log((top[0] + 1).double() * 2.0**-53))
        angle = top[1].double() * (2 * math.pi * 2.0**-53)
        parts.append(torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:count])
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def secure_noisy_average(sums: Sequence[torch.Tensor], std: float, divisor: float,
                         dtypes: Optional[Sequence[torch.dtype]] = None) -> List[torch.Tensor]:
    """``(s + std * z) / divisor`` per tensor, ``z ~ N(0, I)`` drawn as described in the module,
    rounded once to ``dtypes`` (default: each sum's own dtype)."""
    out = []
    for s, dtype in zip(sums, dtypes or [s.dtype for s in sums]):
        acc = s.to(torch.float64)
        if std > 0 and s.numel():
            z = os_normals(s.numel()).add_(os_normals(s.numel()))  # two independent draws per coordinate
            acc = acc.add_(z.view(s.shape).to(s.device), alpha=std / math.sqrt(2))
        out.append(acc.div_(divisor).to(dtype))
    return out
