"""Secure mode: randomness from OS entropy, and noise hardened against floating-point attacks.

Threat: a floating-point Gaussian (or Laplace) sampler does not produce every float near
``s + noise``; the set of values it can output depends on ``s``, so one released value
can reveal which neighbouring dataset produced it (Mironov 2012 for Laplace; Jin et al.
2022 for the Gaussian samplers of DP libraries). Seeded noise is also replayable by
anyone who learns the seed.

What :func:`secure_noisy_average` does, per step:

1. one fresh 64-bit seed from ``os.urandom`` (never a user seed, never reused);
2. every coordinate of the noise is ``(z1 + z2) / sqrt(2)`` with ``z1, z2`` independent
   standard normals: exactly N(0, 1), and the sum of two draws fills the gaps left in the
   output set of a single draw (the mitigation Holohan & Braghin 2021 measured; Opacus'
   secure mode sums several draws for the same reason);
3. noise and sum are combined in float64 and the result is rounded once to the
   parameter's dtype. For float32/bf16 parameters this final rounding snaps the released
   value to a grid 2^29 (or more) times coarser than the float64 noise's resolution, so
   every grid point near ``s`` is reachable whatever ``s`` is (the idea of Mironov's
   snapping mechanism). For float64 parameters step 3 adds nothing.

This is a mitigation, not a proof of exact DP in floating point; the cost is about three
times the default noise generation.
"""
from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence

import torch


def os_entropy(bits: int = 256) -> int:
    """A non-negative integer of ``bits`` random bits from the OS CSPRNG (``os.urandom``)."""
    return int.from_bytes(os.urandom((bits + 7) // 8), "little") >> (-bits % 8)


def secure_noisy_average(sums: Sequence[torch.Tensor], std: float, divisor: float,
                         dtypes: Optional[Sequence[torch.dtype]] = None) -> List[torch.Tensor]:
    """``(s + std * z) / divisor`` per tensor, ``z ~ N(0, I)`` drawn as described in the module,
    rounded once to ``dtypes`` (default: each sum's own dtype)."""
    if not sums:
        return []
    gen = torch.Generator(device=sums[0].device)
    gen.manual_seed(os_entropy(64))
    out = []
    for s, dtype in zip(sums, dtypes or [s.dtype for s in sums]):
        acc = s.to(torch.float64)
        if std > 0:
            z = torch.randn(s.shape, generator=gen, dtype=torch.float64, device=s.device)
            z += torch.randn(s.shape, generator=gen, dtype=torch.float64, device=s.device)
            acc = acc.add_(z, alpha=std / math.sqrt(2))
        out.append(acc.div_(divisor).to(dtype))
    return out
