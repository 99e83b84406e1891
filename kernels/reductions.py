"""Reduction helpers shared by the Triton kernels.

They use Triton builtins only (``tl.reduce``, not the jit-defined ``tl.sum``), so the
kernels also run when ``TRITON_INTERPRET=1`` is set after Triton was imported.
"""
import triton
import triton.language as tl


@triton.jit
def _add(x, y):
    return x + y


@triton.jit
def block_sum(x):
    """Sum of all entries of a block."""
    return tl.reduce(tl.reshape(x, (x.numel,)), 0, _add)
