"""Triton kernels of fastdp (CUDA path), each beside a pure-PyTorch reference."""
