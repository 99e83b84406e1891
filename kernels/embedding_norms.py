"""Per-sample squared norm of an embedding's weight gradient (Triton).

``ids``: ``(B, T)`` token ids, ``g``: ``(B, T, D)``; float64 ``(B,)``. Reference:
:func:`fastdp.ops.embedding_sq_norms_ref`. Each sample's ids are sorted (torch), so equal
ids are adjacent; program ``(i, J)`` walks the sorted positions keeping the running sum
of ``g`` rows (columns J) of the current id and adds its square when the id changes:
O(B T D) work, one partial per program. ``padding_idx`` rows are read as zero.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.reductions import block_sum


@triton.jit
def _embedding_kernel(ids_sorted, order, g, partial, T, D, padding_idx, sgb, sgt, sgd,
                      HAS_PADDING: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # int64 indices: i * stride past 2^31 elements must not wrap
    tile_d = tl.program_id(1)
    cols = (tile_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    run = tl.full((BLOCK_D,), 0, ACC)
    total = tl.full((BLOCK_D,), 0, tl.float64)
    prev = tl.load(ids_sorted + i * T)
    for t in range(0, T):
        token = tl.load(ids_sorted + i * T + t)
        new_id = token != prev
        wide = run.to(tl.float64)  # squared in float64: no overflow past 1.8e19
        total += tl.where(new_id, wide * wide, 0.0)
        run = tl.where(new_id, 0.0, run)
        keep = cols < D
        if HAS_PADDING:
            keep = keep & (cols * 0 + token != padding_idx)
        row = tl.load(g + i * sgb + tl.load(order + i * T + t) * sgt + cols * sgd, mask=keep, other=0.0)
        run += row.to(ACC)
        prev = token
    wide = run.to(tl.float64)
    total += wide * wide
    tl.store(partial + i * tl.num_programs(1) + tile_d + tl.arange(0, 1), block_sum(total)[None])


def embedding_sq_norms_triton(
    ids: torch.Tensor, g: torch.Tensor, padding_idx: Optional[int], block_d: int = 128
) -> torch.Tensor:
    """Sort-and-segment embedding norm, float64 ``(B,)``; see the module docstring."""
    batch, seq = ids.shape
    dim = g.shape[-1]
    if batch == 0 or seq == 0 or dim == 0:
        return torch.zeros(batch, dtype=torch.float64, device=g.device)
    ids_sorted, order = torch.sort(ids, dim=1)
    block_d = min(block_d, triton.next_power_of_2(dim))
    n_tiles = triton.cdiv(dim, block_d)
    partial = torch.empty(batch, n_tiles, dtype=torch.float64, device=g.device)  # every entry is stored
    _embedding_kernel[(batch, n_tiles)](
        ids_sorted.contiguous(), order.contiguous(), g, partial, seq, dim,
        -1 if padding_idx is None else padding_idx, *g.stride(),
        HAS_PADDING=padding_idx is not None, BLOCK_D=block_d,
        ACC=tl.float64 if g.dtype == torch.float64 else tl.float32,
    )
    return partial.sum(1)
