"""Registers the Triton kernels with :mod:`fastdp.ops` as backend ``"triton"``.

On ``"cuda"`` only the embedding norm joins the default choice (3.4-10x faster than the
reference on an H100, and no host sync). Measured there (``bench/RESULTS.md``) but kept
out of the default, selected by ``FASTDP_BACKEND=triton``:

* the ghost norm: 1.5-4.2x faster than the batched-Gram route per call at O(B) extra
  memory, but with it the engine step was slower on two of six benchmark models
  (transformer 1.44x, CIFAR CNN 1.16x; cause not yet measured);
* the direct norm: slower than ``bmm`` on some shapes (0.24-2.5x);
* the noise kernel: the CUDA C++ one in ``fastdp._cuda_ops`` is faster (the Triton one paid
  about 0.5 ms per call building its tables on the device; they are now built on the host
  and copied once each, which has not been timed on a GPU yet).

Under ``TRITON_INTERPRET=1`` all are also registered for ``"cpu"`` tensors (forced only), so
the test suite can run them.
"""
import os

from fastdp import ops
from kernels.embedding_norms import embedding_sq_norms_triton
from kernels.linear_norms import linear_sq_norms_direct_triton, linear_sq_norms_ghost_triton
from kernels.noise import noisy_average_triton

_KERNELS = {  # op: (kernel, in the default choice on CUDA)
    "linear_sq_norms_ghost": (linear_sq_norms_ghost_triton, False),
    "linear_sq_norms_direct": (linear_sq_norms_direct_triton, False),
    "embedding_sq_norms": (embedding_sq_norms_triton, True),
    "noisy_average": (noisy_average_triton, False),
}

for _device in ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",):
    for _op, (_fn, _auto) in _KERNELS.items():
        ops.register(_op, "triton", _device, auto=_auto and _device == "cuda")(_fn)
