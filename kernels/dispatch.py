"""Registers the Triton kernels with :mod:`fastdp.ops` as backend ``"triton"``.

On ``"cuda"`` one joins the default choice (measured on an H100, ``bench/RESULTS.md``): the
embedding norm (3.5-12x faster than the reference, and no host sync).

Kept out of the default, selected by ``FASTDP_BACKEND=triton``:

* the ghost norm: it now forms its Gram tiles in float64 (as every ghost route does, so
  that cancelling terms cannot hide a sample from clipping), which is unmeasured on a GPU.
  With float32 (3xTF32) Grams it was 1.5-4.2x faster per call than the batched-Gram route
  at O(B) extra memory, and in the default for calls of at least 1e10 multiply-adds;
* the direct norm: slower than ``bmm`` on some shapes (0.24-2.5x);
* the noise kernel: the CUDA C++ one in ``fastdp._cuda_ops`` is faster (the Triton one is
  2.2x a copy on 67M elements, and its host work costs 0.07-0.24 ms a call below ~10M).

Under ``TRITON_INTERPRET=1`` all are also registered for ``"cpu"`` tensors (forced only), so
the test suite can run them.
"""
import functools
import os

import torch

from fastdp import ops
from kernels.embedding_norms import embedding_sq_norms_triton
from kernels.linear_norms import linear_sq_norms_direct_triton, linear_sq_norms_ghost_triton
from kernels.noise import noisy_average_triton


def _noisy_average(sums, std: float, divisor: float, seed: int, inplace: bool = False):
    ops.check_float32_noise_scalars(std, divisor)  # the kernel takes both as float32
    return noisy_average_triton(sums, std, divisor, seed, inplace)


_KERNELS = {  # op: (kernel, in the default choice on CUDA)
    "linear_sq_norms_ghost": (linear_sq_norms_ghost_triton, False),
    "linear_sq_norms_direct": (linear_sq_norms_direct_triton, False),
    "embedding_sq_norms": (embedding_sq_norms_triton, True),
    "noisy_average": (_noisy_average, False),
}



def _on_operands_gpu(fn):
    """``fn`` run with its first tensor's GPU as the current device: Triton launches on the current
    device and its stream, not the tensors' (a model on cuda:1 in a thread whose device is 0)."""
    @functools.wraps(fn)
    def run(first, *args, **kwargs):
        with torch.cuda.device((first[0] if isinstance(first, (list, tuple)) else first).device):
            return fn(first, *args, **kwargs)
    return run


for _device in ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",):
    for _op, (_fn, _auto) in _KERNELS.items():
        ops.register(_op, "triton", _device, auto=_auto and _device == "cuda")(
            _on_operands_gpu(_fn) if _device == "cuda" else _fn)
