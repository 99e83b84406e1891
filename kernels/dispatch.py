"""Registers the Triton kernels with :mod:`fastdp.ops` as backend ``"triton"``.

On ``"cuda"``, kernels measured faster than the PyTorch references on an H100
(``bench/kernels_table.py --cuda``, ``bench/RESULTS.md``) join the default choice: the
ghost norm (1.3-4x faster than batched Gram matrices, O(B) extra memory) and the
embedding norm (3.5-11x). The direct norm (slower than ``bmm`` on half the shapes) and the
noise kernel (the CUDA C++ one in ``fastdp._cuda_ops`` is faster) are selected only by
``FASTDP_BACKEND=triton``. Under ``TRITON_INTERPRET=1`` all are also registered for
``"cpu"`` tensors (forced only), so the test suite can run them.
"""
import os

from fastdp import ops
from kernels.embedding_norms import embedding_sq_norms_triton
from kernels.linear_norms import linear_sq_norms_direct_triton, linear_sq_norms_ghost_triton
from kernels.noise import noisy_average_triton

_KERNELS = {  # op: (kernel, in the default choice on CUDA)
    "linear_sq_norms_ghost": (linear_sq_norms_ghost_triton, True),
    "linear_sq_norms_direct": (linear_sq_norms_direct_triton, False),
    "embedding_sq_norms": (embedding_sq_norms_triton, True),
    "noisy_average": (noisy_average_triton, False),
}

for _device in ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",):
    for _op, (_fn, _auto) in _KERNELS.items():
        ops.register(_op, "triton", _device, auto=_auto and _device == "cuda")(_fn)
