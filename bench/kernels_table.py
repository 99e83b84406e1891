"""Kernel microbenchmarks: time of the PyTorch composite / time of the kernel, same math.

    .venv/bin/python bench/kernels_table.py            # CPU: native kernels
    .venv/bin/python bench/kernels_table.py --cuda     # GPU: Triton kernels (needs CUDA)

A ratio above 1 means the kernel is faster. Best of ``--repeat`` runs after a warm-up.
"""
from __future__ import annotations

import argparse
import time

import torch

from fastdp import ops


def best_ms(fn, repeat: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def noise_rows(impl, device, repeat, sync):
    for sizes in ([1 << 20], [1 << 23], [4096] * 256 + [1 << 20]):
        sums = [torch.randn(n, device=device) for n in sizes]
        outs = [torch.empty_like(s) for s in sums]
        composite = lambda: [(s + torch.randn_like(s) * 1.3) / 7.0 for s in sums]
        copy = lambda: [o.copy_(s) for o, s in zip(outs, sums)]
        t_ref, t_copy = best_ms(composite, repeat, sync), best_ms(copy, repeat, sync)
        t_k = best_ms(lambda: impl(sums, 1.3, 7.0, 11), repeat, sync)
        label = f"noise {len(sizes)} tensors, {sum(sizes) / 1e6:.2f}M"
        yield label, t_ref, t_k, f"kernel/copy {t_k / t_copy:.1f}"


def norm_rows(impls, device, repeat, sync):
    for dtype in (torch.float32,):
        for b, t, d, p in ((32, 256, 256, 256), (16, 1024, 128, 128), (64, 64, 512, 512)):
            a = torch.randn(b, t, d, device=device, dtype=dtype)
            g = torch.randn(b, t, p, device=device, dtype=dtype)
            for op in ("linear_sq_norms_ghost", "linear_sq_norms_direct"):
                if op in impls:
                    ref, fn = ops._REFERENCE[op], impls[op]
                    yield (f"{op[16:]} B{b} T{t} d{d} p{p}", best_ms(lambda: ref(a, g), repeat, sync),
                           best_ms(lambda: fn(a, g), repeat, sync), "")
    if "embedding_sq_norms" in impls:
        for b, t, dim, vocab in ((64, 128, 256, 1000), (32, 512, 768, 30000), (256, 64, 64, 50)):
            ids = torch.randint(0, vocab, (b, t), device=device)
            g = torch.randn(b, t, dim, device=device)
            ref, fn = ops._REFERENCE["embedding_sq_norms"], impls["embedding_sq_norms"]
            yield (f"embedding B{b} T{t} D{dim} V{vocab}", best_ms(lambda: ref(ids, g, 0), repeat, sync),
                   best_ms(lambda: fn(ids, g, 0), repeat, sync), "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="time the Triton kernels on the GPU")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    ops._load_backends()
    if args.cuda:
        device, backend, sync = "cuda", "triton", torch.cuda.synchronize
    else:
        device, backend, sync = "cpu", "native", lambda: None
    impls = {op: fn for op, by in ops._REGISTRY.items() for (b, dev), fn in by.items() if (b, dev) == (backend, device)}
    print(f"{backend} on {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'case':44s} {'torch ms':>9s} {'kernel ms':>9s} {'ratio':>6s}")
    rows = list(norm_rows(impls, device, args.repeat, sync))
    if "noisy_average" in impls:
        rows += list(noise_rows(impls["noisy_average"], device, args.repeat, sync))
    for label, t_ref, t_k, extra in rows:
        print(f"{label:44s} {t_ref:9.3f} {t_k:9.3f} {t_ref / t_k:6.1f}  {extra}")


if __name__ == "__main__":
    main()
