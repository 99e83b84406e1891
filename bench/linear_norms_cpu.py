"""Per-sample linear-layer norms on CPU: PyTorch references vs the native tiled kernels.

    .venv/bin/python bench/linear_norms_cpu.py --threads 1
    .venv/bin/python bench/linear_norms_cpu.py --threads 2 --repeat 30

Times are best-of-``--repeat`` ms after a warm-up, all four routes timed in one process on
the same tensors. Ratios are reference / native (above 1: native faster), ghost against
the ghost reference and direct against the direct reference. Extra memory is what each
route allocates besides its inputs and the (B,) output: the references' bmm outputs
(2 B T^2 or B p d floats), the kernels' float64 partial sums plus per-thread scratch.
"""
from __future__ import annotations

import argparse

import torch
from kernels_table import best_ms  # bench/ is the script's directory, so on sys.path

from fastdp import _native_ops as native
from fastdp import ops

SHAPES = ((32, 256, 256, 256), (16, 1024, 128, 128), (64, 64, 512, 512), (256, 16, 64, 10), (64, 49, 32, 64))
TILE, CHUNK = 64, 64  # csrc/linear_norms.cpp: TB and TC


def cdiv(n: int, k: int) -> int:
    return -(-n // k)


def extra_mib(b, t, d, p, threads, elem=4):
    """Extra bytes of (ghost ref, direct ref, native ghost, native direct), in MiB, from the
    allocations in ops.py and csrc/linear_norms.cpp: the ghost routes work in float64 (the
    reference on float64 copies of a and g and two float64 Grams; the kernel on float64 tiles),
    the direct reference squares its float32 per-sample gradients in float64."""
    ghost_ref = (b * t * (d + p) * 8 if elem != 8 else 0) + 2 * b * t * t * 8
    direct_ref = b * p * d * elem + (b * p * d * 8 if elem != 8 else 0)
    lanes = 64 // elem
    ghost = 8 * b * cdiv(t, TILE) + threads * (TILE * (d + p) + 2 * TILE * TILE) * 8
    direct = 8 * b * cdiv(p, TILE) * cdiv(d, TILE) + threads * (2 * CHUNK * lanes + TILE * TILE) * elem
    return [x / 2**20 for x in (ghost_ref, direct_ref, ghost, direct)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # also the OpenMP team size of fastdp._C (one libgomp)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.dtype}, best of {args.repeat}")
    print(f"{'B':>4s} {'T':>5s} {'d':>4s} {'p':>4s} | {'ref ghost':>9s} {'ref dir':>8s} {'nat ghost':>9s} "
          f"{'nat dir':>8s} | {'ghost x':>7s} {'dir x':>6s} | extra MiB: ref ghost/dir, native ghost/dir")
    for b, t, d, p in SHAPES:
        torch.manual_seed(0)
        a, g = torch.randn(b, t, d, dtype=dtype), torch.randn(b, t, p, dtype=dtype)
        ms = [best_ms(lambda: fn(a, g), args.repeat) for fn in (
            ops.linear_sq_norms_ghost_ref, ops.linear_sq_norms_direct_ref,
            native.linear_sq_norms_ghost, native.linear_sq_norms_direct)]
        mem = extra_mib(b, t, d, p, args.threads, a.element_size())
        print(f"{b:4d} {t:5d} {d:4d} {p:4d} | {ms[0]:9.3f} {ms[1]:8.3f} {ms[2]:9.3f} {ms[3]:8.3f} | "
              f"{ms[0] / ms[2]:7.2f} {ms[1] / ms[3]:6.2f} | " + " / ".join(f"{m:.3g}" for m in mem))


if __name__ == "__main__":
    main()
