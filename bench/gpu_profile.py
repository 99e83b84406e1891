"""GPU diagnostics for a lent machine (not part of CI): Triton ghost-norm tile/precision
variants against the batched-Gram route, and where a fastdp step's time goes.

    python3 bench/gpu_profile.py ghost            # variants table (ms, rel. error, extra MiB)
    python3 bench/gpu_profile.py noise            # Triton noise launch shapes vs copy and CUDA C++
    python3 bench/gpu_profile.py ghost-engine ... # engine step, ghost norm on the reference / Triton
    python3 bench/gpu_profile.py step mlp ...     # per-step ms, host syncs, top CPU ops

Times are medians of CUDA-event timings (``triton.testing.do_bench``).
"""
from __future__ import annotations

import copy
import sys
import warnings

import torch
from triton.testing import do_bench

from fastdp import bench, ops
from kernels.linear_norms import linear_sq_norms_ghost_triton

GHOST_SHAPES = ((32, 256, 256, 256), (16, 1024, 128, 128), (64, 64, 512, 512), (32, 128, 768, 3072),
                (16, 512, 4096, 4096), (32, 128, 256, 1024))
# (block_t, block_k, num_warps, num_stages, float32 precision)
VARIANTS = ((64, 32, 4, 2, "ieee"), (64, 64, 4, 3, "ieee"), (128, 32, 8, 3, "ieee"),
            (64, 32, 4, 3, "tf32x3"), (64, 64, 4, 3, "tf32x3"), (128, 32, 8, 3, "tf32x3"),
            (128, 64, 8, 3, "tf32x3"), (128, 64, 8, 4, "tf32x3"))


def ghost_table() -> None:
    print(f"{'shape':28s} {'dtype':9s} {'variant':26s} {'ms':>8s} {'ref ms':>8s} {'ratio':>6s} {'rel err':>9s}")
    for b, t, d, p in GHOST_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(b, t, d, device="cuda", dtype=dtype)
            g = torch.randn(b, t, p, device="cuda", dtype=dtype)
            exact = ops.linear_sq_norms_direct_ref(a.double(), g.double())
            ref_ms = do_bench(lambda: ops.linear_sq_norms_ghost_ref(a, g), return_mode="median")
            seen = set()
            for bt, bk, warps, stages, prec in VARIANTS:
                if dtype != torch.float32 and (bt, bk, warps, stages) in seen:
                    continue  # precision only matters for float32
                seen.add((bt, bk, warps, stages))
                fn = lambda: linear_sq_norms_ghost_triton(a, g, bt, bk, warps, stages, prec)  # noqa: E731
                try:
                    err = float(((fn() - exact).abs() / exact).max())
                    ms = do_bench(fn, return_mode="median")
                except Exception as exc:  # a config the compiler rejects (shared memory)
                    print(f"{(b, t, d, p)!s:28s} {str(dtype)[6:]:9s} {bt, bk, warps, stages, prec!s:26s} "
                          f"failed: {type(exc).__name__}")
                    continue
                print(f"{(b, t, d, p)!s:28s} {str(dtype)[6:]:9s} {bt, bk, warps, stages, prec!s:26s} "
                      f"{ms:8.3f} {ref_ms:8.3f} {ref_ms / ms:6.2f} {err:9.1e}", flush=True)


def noise_table() -> None:
    """Triton noise kernel's launch shape (groups per program, warps) against a device copy and
    the CUDA C++ kernel, in place on one tensor."""
    from fastdp import _cuda_ops
    from kernels.noise import noisy_average_triton
    print(f"{'numel':>10s} {'groups/prog':>11s} {'warps':>5s} {'ms':>8s} {'copy ms':>8s} {'cuda ms':>8s}")
    for numel in (1 << 20, 1 << 23, 1 << 26):
        s = torch.randn(numel, device="cuda")
        copy_ms = do_bench(lambda: s.clone(), return_mode="median")
        cuda_ms = do_bench(lambda: _cuda_ops.noisy_average([s], 1.0, 2.0, 7, inplace=True), return_mode="median")
        for per_prog in (1, 2, 4):
            for warps in (1, 2, 4, 8):
                fn = lambda: noisy_average_triton([s], 1.0, 2.0, 7, inplace=True,  # noqa: E731
                                                  groups_per_prog=per_prog, num_warps=warps)
                print(f"{numel:10d} {per_prog:11d} {warps:5d} {do_bench(fn, return_mode='median'):8.3f} "
                      f"{copy_ms:8.3f} {cuda_ms:8.3f}", flush=True)


def ghost_in_engine(configs) -> None:
    """In-process A/B of the fastdp step with the Triton ghost norm out of the CUDA default
    dispatch (every ghost call on the reference, as registered) and in it (every ghost call
    on the kernel), alternating rounds; ratios to the non-private step."""
    ops._load_backends()
    triton_ghost = ("linear_sq_norms_ghost", "triton", "cuda")
    registered_auto = triton_ghost not in ops._FORCED_ONLY
    kernel = ops._REGISTRY[triton_ghost[0]][triton_ghost[1:]]
    print(f"{'config':16s} {'nonprivate ms':>13s} {'reference ghost':>15s} {'triton ghost':>12s}")
    for config in configs:
        torch.manual_seed(0)
        model, x, y, per_sample = bench.CONFIGS[config][0](False)
        model, x, y = model.cuda(), x.cuda(), y.cuda()
        crit = bench.SampleLoss(per_sample)
        plain_model = copy.deepcopy(model)
        plain = bench._plain_step(plain_model, x, y, crit, torch.optim.SGD(plain_model.parameters(), lr=1e-3))
        private = bench._fastdp_step(model, x, y, crit, torch.optim.SGD(model.parameters(), lr=1e-3))
        times = {"nonprivate": [], "reference": [], "triton": []}
        for _ in range(4):
            for arm in times:
                ops.register(*triton_ghost, auto=arm == "triton")(kernel)
                fn = plain if arm == "nonprivate" else private
                times[arm].append(do_bench(fn, warmup=20, rep=150, return_mode="median"))
        med = {arm: sorted(t)[len(t) // 2] for arm, t in times.items()}
        print(f"{config:16s} {med['nonprivate']:13.3f} {med['reference'] / med['nonprivate']:15.2f} "
              f"{med['triton'] / med['nonprivate']:12.2f}", flush=True)
    ops.register(*triton_ghost, auto=registered_auto)(kernel)


def profile_step(config: str) -> None:
    torch.manual_seed(0)
    model, x, y, per_sample = bench.CONFIGS[config][0](False)
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    crit = bench.SampleLoss(per_sample)
    for method in ("nonprivate", "fastdp"):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        step = (bench._fastdp_step if method == "fastdp" else bench._plain_step)(m, x, y, crit, opt)
        for _ in range(5):
            step()
        ms = do_bench(step, warmup=50, rep=300, return_mode="median")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        torch.cuda.set_sync_debug_mode(0)
        syncs = sorted({str(w.message).splitlines()[0][:80] for w in caught})
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        cuda_ms = sum(e.self_device_time_total for e in events) / 3e3
        print(f"\n== {config} {method}: {ms:.3f} ms/step (events), GPU busy {cuda_ms:.3f} ms/step, "
              f"{len(caught)} host syncs: {syncs}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "ghost"
    if what == "ghost":
        ghost_table()
    elif what == "noise":
        noise_table()
    elif what == "ghost-engine":
        ghost_in_engine(sys.argv[2:] or ["transformer", "wide-linear", "mnist-cnn-b256", "cifar-cnn-gn"])
    else:
        for config in sys.argv[2:] or ["mlp"]:
            profile_step(config)
