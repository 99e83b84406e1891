"""Registers the Triton kernels with :mod:`fastdp.ops` as backend ``"triton"``.

On ``"cuda"`` they are registered with ``auto=False``: none has been timed on a GPU yet
(``bench/kernels_table.py`` does it), so the default path keeps the PyTorch references
and ``FASTDP_BACKEND=triton`` selects them. Under ``TRITON_INTERPRET=1`` they are also
registered for ``"cpu"`` tensors (forced only), so the test suite can run them.
"""
import os

from fastdp import ops
from kernels.embedding_norms import embedding_sq_norms_triton
from kernels.linear_norms import linear_sq_norms_direct_triton, linear_sq_norms_ghost_triton
from kernels.noise import noisy_average_triton

_KERNELS = {
    "linear_sq_norms_ghost": linear_sq_norms_ghost_triton,
    "linear_sq_norms_direct": linear_sq_norms_direct_triton,
    "embedding_sq_norms": embedding_sq_norms_triton,
    "noisy_average": noisy_average_triton,
}

for _device in ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",):
    for _op, _fn in _KERNELS.items():
        ops.register(_op, "triton", _device, auto=False)(_fn)
