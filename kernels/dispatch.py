"""Registers the Triton kernels with :mod:`fastdp.ops` as backend ``"triton"``.

On ``"cuda"`` two join the default choice (measured on an H100, ``bench/RESULTS.md``):

* the embedding norm (3.5-12x faster than the reference, and no host sync);
* the ghost norm, for calls of at least ``GHOST_TRITON_MIN_WORK`` multiply-adds only. Per
  call it is 1.5-4.2x faster than the batched-Gram route at O(B) extra memory, but in the
  engine it made the host-bound steps slower (transformer 2.45x -> 2.65x the non-private
  step, CIFAR CNN 2.56x -> 3.20x) and only the GPU-bound wide linear faster (1.18x -> 1.11x).

Kept out of the default, selected by ``FASTDP_BACKEND=triton`` (which also sends every ghost
call to the kernel):

* the direct norm: slower than ``bmm`` on some shapes (0.24-2.5x);
* the noise kernel: the CUDA C++ one in ``fastdp._cuda_ops`` is faster (the Triton one is
  2.2x a copy on 67M elements, and its host work costs 0.07-0.24 ms a call below ~10M).

Under ``TRITON_INTERPRET=1`` all are also registered for ``"cpu"`` tensors (forced only), so
the test suite can run them.
"""
import os

import torch

from fastdp import ops
from kernels.embedding_norms import embedding_sq_norms_triton
from kernels.linear_norms import linear_sq_norms_direct_triton, linear_sq_norms_ghost_triton
from kernels.noise import noisy_average_triton

# Smallest ghost-norm call, B * T^2 * (d + p) multiply-adds, that the default sends to the
# kernel: between the largest call of the transformer benchmark (5.4e9, whose step the kernel
# made slower) and the wide linear's (3.4e10, faster); the crossover in between is unmeasured.
GHOST_TRITON_MIN_WORK = 1e10


def linear_sq_norms_ghost_large(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The Triton ghost norm for calls of at least ``GHOST_TRITON_MIN_WORK`` (every call when
    ``FASTDP_BACKEND=triton``), the batched-Gram reference below."""
    batch, seq, d = a.shape
    if batch * seq * seq * (d + g.shape[-1]) < GHOST_TRITON_MIN_WORK and ops.selected_backend() != "triton":
        return ops.linear_sq_norms_ghost_ref(a, g)
    return linear_sq_norms_ghost_triton(a, g)


_KERNELS = {  # op: (kernel, in the default choice on CUDA)
    "linear_sq_norms_ghost": (linear_sq_norms_ghost_large, True),
    "linear_sq_norms_direct": (linear_sq_norms_direct_triton, False),
    "embedding_sq_norms": (embedding_sq_norms_triton, True),
    "noisy_average": (noisy_average_triton, False),
}

for _device in ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",):
    for _op, (_fn, _auto) in _KERNELS.items():
        ops.register(_op, "triton", _device, auto=_auto and _device == "cuda")(_fn)
