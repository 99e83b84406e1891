"""Kernel microbenchmarks: time of the PyTorch composite / time of the kernel, same math.

    .venv/bin/python bench/kernels_table.py            # CPU: native (C++) kernels
    .venv/bin/python bench/kernels_table.py --cuda     # GPU: Triton and CUDA C++ kernels

A ratio above 1 means the kernel is faster. On the "conv direct + input grad" rows the
"torch ms" column is the unfused pair, the native direct kernel plus aten's input gradient,
against the kernel writing both. CPU: best of ``--repeat`` runs after a warm-up. GPU: median of CUDA-event timings (``triton.testing.do_bench``). The "extra MiB"
column (GPU only) is the peak memory a call allocates beyond its inputs, reference / kernel.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from fastdp import ops
from fastdp.allocator import keep_freed_memory


def best_ms(fn, repeat: int, sync=lambda: None) -> float:
    """Best of ``repeat`` wall-clock runs after one warm-up, in ms (``sync`` waits for a GPU)."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def cuda_ms(fn, repeat: int, sync) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=max(100, 5 * repeat), return_mode="median")


def extra_mib(fn, device) -> str:
    """Peak memory allocated during ``fn()`` beyond what was allocated before (CUDA)."""
    if device != "cuda":
        return ""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.1f}"


def noise_rows(impls, device, repeat, timer, sync):
    # 8.4 M as 8 tensors: one of 2^23 floats is 32 MiB, where glibc maps every temporary of the
    # composite afresh (its mmap threshold stops growing there) and the ratio times page faults
    for sizes in ([1 << 20], [1 << 20] * 8, [1 << 26], [4096] * 256 + [1 << 20]):
        if device == "cpu" and sizes[0] == 1 << 26:
            continue
        sums = [torch.randn(n, device=device) for n in sizes]
        outs = [torch.empty_like(s) for s in sums]
        composite = lambda: [(s + torch.randn_like(s) * 1.3) / 7.0 for s in sums]  # noqa: E731
        copy = lambda: [o.copy_(s) for o, s in zip(outs, sums)]  # noqa: E731
        t_ref, t_copy = timer(composite, repeat, sync), timer(copy, repeat, sync)
        for name, impl in impls:
            for inplace in (False, True):  # in place (as the optimizer calls it): no fresh output pages
                t_k = timer(lambda: impl(sums, 1.3, 7.0, 11, inplace=inplace), repeat, sync)
                label = f"noise[{name}{', in place' if inplace else ''}] {len(sizes)} tensors, {sum(sizes) / 1e6:.2f}M"
                yield label, t_ref, t_k, f"kernel/copy {t_k / t_copy:.2f}"


LINEAR_SHAPES = {
    "cpu": ((32, 256, 256, 256), (16, 1024, 128, 128), (64, 64, 512, 512)),
    "cuda": ((32, 256, 256, 256), (16, 1024, 128, 128), (64, 64, 512, 512), (32, 128, 768, 3072),
             (8, 2048, 1024, 1024), (256, 49, 64, 128)),
}


def norm_rows(impls, device, repeat, timer, sync):
    dtypes = (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,)
    for dtype in dtypes:
        for b, t, d, p in LINEAR_SHAPES[device]:
            a = torch.randn(b, t, d, device=device, dtype=dtype)
            g = torch.randn(b, t, p, device=device, dtype=dtype)
            for op in ("linear_sq_norms_ghost", "linear_sq_norms_direct"):
                if op in impls:
                    ref, fn = ops._REFERENCE[op], impls[op]
                    mem = extra_mib(lambda: ref(a, g), device), extra_mib(lambda: fn(a, g), device)
                    yield (f"{op[16:]} {str(dtype)[6:]} B{b} T{t} d{d} p{p}", timer(lambda: ref(a, g), repeat, sync),
                           timer(lambda: fn(a, g), repeat, sync), f"extra MiB {mem[0]} / {mem[1]}" if mem[0] else "")
    if "embedding_sq_norms" in impls:
        for b, t, dim, vocab in ((64, 128, 256, 1000), (32, 512, 768, 30000), (256, 64, 64, 50)):
            ids = torch.randint(0, vocab, (b, t), device=device)
            g = torch.randn(b, t, dim, device=device)
            ref, fn = ops._REFERENCE["embedding_sq_norms"], impls["embedding_sq_norms"]
            yield (f"embedding B{b} T{t} D{dim} V{vocab}", timer(lambda: ref(ids, g, 0), repeat, sync),
                   timer(lambda: fn(ids, g, 0), repeat, sync), "")


CONV_LAYERS = (  # (batch, C_in, C_out, image size, kernel, stride, padding): the CIFAR and MNIST CNNs' layers
    (128, 3, 32, 32, 3, 1, 1), (128, 32, 64, 16, 3, 1, 1), (128, 64, 64, 8, 3, 1, 1), (128, 64, 128, 4, 3, 1, 1),
    (256, 1, 16, 28, 8, 2, 2), (256, 16, 32, 13, 4, 2, 0), (64, 16, 32, 12, 4, 2, 0))


def conv_case(b, cin, cout, size, k, stride, pad, device="cpu"):
    """Random input and output gradient of a square 2-D convolution layer, its spec and weight shape."""
    from fastdp.layers.conv import ConvSpec

    out = (size + 2 * pad - k) // stride + 1
    x, g = torch.randn(b, cin, size, size, device=device), torch.randn(b, cout, out, out, device=device)
    return x, g, ConvSpec([stride] * 2, [pad] * 2, [1, 1], 1, [k, k]), (cout, cin, k, k)


def conv_routes(x, g, spec, weight_shape, fused):
    """Ways to the per-sample weight norms of one convolution: the rule's composed routes
    (unfold + ghost norm; per-sample gradients from one grouped convolution) and ``fused``
    (``ops.conv_sq_norms``' signature) for each route, and its direct route writing the input
    gradient too; plus, as yardsticks, the layer's summed weight gradient, which is what the
    non-private step pays for it, and aten's input gradient, which both steps pay."""
    from fastdp.ops import sample_sq_norms
    from fastdp.layers.conv import ConvRule, _convolution_backward

    rule = ConvRule()
    seq, d, p = g[0, 0].numel(), x.shape[1] * spec.kernel[0] * spec.kernel[1], g.shape[1]
    weight = torch.randn(weight_shape, device=x.device)
    return {
        "composed ghost (unfold)": lambda: rule._ghost_sq_norms(x, g, spec, d, p, seq),
        "composed direct (grouped conv)": lambda: sample_sq_norms(rule._per_sample_weight(x, g, spec, weight_shape)),
        "native ghost": lambda: fused(x, g, spec, True)[0],
        "native direct": lambda: fused(x, g, spec, False)[0],
        "native direct, kept gradients": lambda: fused(x, g, spec, False, keep_grads=True)[0],
        "native direct, input gradient": lambda: fused(x, g, spec, False, input_weight=weight)[3],
        "weight gradient": lambda: _convolution_backward(g, x, weight_shape, spec, 1, [False, True, False])[1],
        "input gradient": lambda: _convolution_backward(g, x, weight, spec, 1, [True, False, False])[0],
    }


def conv_rows(impls, device, repeat, timer, sync):
    """The fused convolution norm against the composed routes, and the extra column: kernel
    time / the layer's weight-gradient time. Then the direct route writing the input gradient
    too against the direct route and aten's input gradient, and the extra column: what the
    input gradient adds to the kernel / aten's input gradient (the rule takes the fused one
    where it is the faster, by timing)."""
    if "conv_sq_norms" not in impls:
        return
    for b, cin, cout, size, k, stride, pad in CONV_LAYERS:
        routes = conv_routes(*conv_case(b, cin, cout, size, k, stride, pad, device), impls["conv_sq_norms"])
        t_weight = timer(routes["weight gradient"], repeat, sync)
        name = f"B{b} {cin}->{cout} {size}px k{k} s{stride}"
        for route, composed in (("ghost", "composed ghost (unfold)"), ("direct", "composed direct (grouped conv)")):
            t_ref = timer(routes[composed], repeat, sync)
            t_k = timer(routes[f"native {route}"], repeat, sync)
            yield f"conv {route} {name}", t_ref, t_k, f"kernel/weight-grad {t_k / t_weight:.2f}"
        t_input = timer(routes["input gradient"], repeat, sync)
        t_both = timer(routes["native direct, input gradient"], repeat, sync)
        yield (f"conv direct + input grad {name}", t_k + t_input, t_both,  # "torch": native direct + aten dx
               f"added/aten input-grad {(t_both - t_k) / t_input:.2f}")


# (batch, channels, image size, groups): the CIFAR CNN's GroupNorm layers
GROUP_NORM_LAYERS = ((128, 32, 32, 8), (128, 64, 16, 8), (128, 64, 8, 8), (128, 128, 4, 8))


def group_norm_case(b, c, size, groups, device="cpu"):
    """Input, weight, saved statistics and output gradient of a GroupNorm layer."""
    x = torch.randn(b, c, size, size, device=device)
    weight, bias = torch.randn(c, device=device), torch.randn(c, device=device)
    _, mean, rstd = torch.ops.aten.native_group_norm(x, weight, bias, b, c, size * size, groups, 1e-5)
    return torch.randn_like(x), x, mean, rstd, weight, groups


def group_norm_routes(case, fused):
    """The reference (aten's input gradient plus per-channel sums), ``fused`` (the op's
    signature) and, as a yardstick, aten's full backward: what the non-private step pays."""
    g, x, mean, rstd, weight, groups = case
    b, c = x.shape[:2]
    return {
        "reference": lambda: ops.group_norm_backward_ref(*case, True),
        "native": lambda: fused(*case, True),
        "aten backward": lambda: torch.ops.aten.native_group_norm_backward(
            g, x, mean, rstd, weight, b, c, x[0, 0].numel(), groups, [True, True, True]),
    }


def group_norm_rows(impls, device, repeat, timer, sync):
    """GroupNorm backward with per-sample gradients against the reference; the extra column:
    kernel time / aten's non-private backward."""
    if "group_norm_backward" not in impls:
        return
    for b, c, size, groups in GROUP_NORM_LAYERS:
        routes = group_norm_routes(group_norm_case(b, c, size, groups, device), impls["group_norm_backward"])
        t_ref, t_k, t_aten = (timer(routes[r], repeat, sync) for r in ("reference", "native", "aten backward"))
        yield (f"group norm backward B{b} C{c} {size}px G{groups}", t_ref, t_k,
               f"kernel/aten-backward {t_k / t_aten:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="time the Triton and CUDA C++ kernels on the GPU")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    if args.cuda and not torch.cuda.is_available():
        raise SystemExit("kernels_table.py: --cuda, but this torch sees no CUDA GPU; run without --cuda")
    keep_freed_memory()  # as fastdp bench does for every method: no page faults on re-allocation
    ops._load_backends()
    registered = lambda backend, dev: {  # noqa: E731
        op: fn for op, by in ops._REGISTRY.items() for (b, d), fn in by.items() if (b, d) == (backend, dev)}
    if args.cuda:
        # every call to the kernel: by default the ghost norm sends small calls to the reference
        os.environ["FASTDP_BACKEND"] = "triton"
        device, backend, sync, timer = "cuda", "triton", torch.cuda.synchronize, cuda_ms
        header = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    else:
        device, backend, sync, timer = "cpu", "native", (lambda: None), best_ms
        header = f"CPU, torch {torch.__version__}, {torch.get_num_threads()} threads"
    impls = registered(backend, device)
    noise_impls = [(backend, impls["noisy_average"])] if "noisy_average" in impls else []
    if args.cuda and "noisy_average" in registered("native", "cuda"):
        noise_impls.append(("cuda-c++", registered("native", "cuda")["noisy_average"]))
    print(f"{backend} kernels on {header}")
    print(f"{'case':48s} {'torch ms':>9s} {'kernel ms':>9s} {'ratio':>6s}")
    rows = list(norm_rows(impls, device, args.repeat, timer, sync))
    rows += list(conv_rows(impls, device, args.repeat, timer, sync))
    rows += list(group_norm_rows(impls, device, args.repeat, timer, sync))
    rows += list(noise_rows(noise_impls, device, args.repeat, timer, sync))
    for label, t_ref, t_k, extra in rows:
        print(f"{label:48s} {t_ref:9.3f} {t_k:9.3f} {t_ref / t_k:6.2f}  {extra}", flush=True)


if __name__ == "__main__":
    main()
