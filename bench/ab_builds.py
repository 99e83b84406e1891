"""In-process A/B of two builds of the native extension ``fastdp._C``.

    # build the baseline, keep a copy, rebuild the change, then:
    .venv/bin/python bench/ab_builds.py OLD.so NEW.so [--configs mnist-cnn-b64,cifar-cnn-gn] [--rounds 300]
    .venv/bin/python bench/ab_builds.py OLD.so NEW.so --calls conv     # one kernel's calls: conv, linear, noise

Each build is copied into a package of its own (Python caches an extension module by its
name, so two files imported under the same name would give one module twice) and the
engine's kernels are switched between them step by step, in alternating order, with the
non-private step of the same model timed beside them. Prints, per config, each build's
step time as a ratio to the non-private step (minimum and median) and the median of the
paired differences (new - old), which host drift hits least. The Python wrappers of this
checkout call both builds, so the two must have the same bindings (e.g. a build from before
the convolution kernel took the input gradient's arguments cannot be compared with one after).
"""
from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fastdp import _native_ops, bench
from fastdp.allocator import keep_freed_memory
from fastdp.layers.conv import ConvSpec
from interleaved import build_steps  # bench/ is on sys.path when run as a script

CONV_LAYERS = {  # name: (input shape without the batch, weight shape, geometry)
    "MNIST conv1": ((1, 28, 28), (16, 1, 8, 8), ConvSpec((2, 2), (2, 2), (1, 1), 1, (8, 8))),
    "MNIST conv2": ((16, 12, 12), (32, 16, 4, 4), ConvSpec((2, 2), (0, 0), (1, 1), 1, (4, 4))),
    "CIFAR conv1": ((3, 32, 32), (32, 3, 3, 3), ConvSpec((1, 1), (1, 1), (1, 1), 1, (3, 3))),
    "CIFAR conv2": ((32, 16, 16), (64, 32, 3, 3), ConvSpec((1, 1), (1, 1), (1, 1), 1, (3, 3))),
}


def load_builds(old: str, new: str) -> dict:
    """Import the two shared objects as ``fastdp_ab_old._C`` and ``fastdp_ab_new._C``."""
    root = Path(tempfile.mkdtemp(prefix="fastdp-ab-"))
    sys.path.insert(0, str(root))
    builds = {}
    for label, path in (("old", old), ("new", new)):
        package = root / f"fastdp_ab_{label}"
        package.mkdir()
        (package / "__init__.py").touch()
        shutil.copy(path, package / Path(_native_ops._C.__file__).name)
        builds[label] = importlib.import_module(f"fastdp_ab_{label}._C")
    return builds


def alternate(builds: dict, run, rounds: int, warmup: int = 5, beside=None) -> dict:
    """Seconds of ``run()`` per round with each build in turn, the order flipped every round;
    ``beside`` (if given) is timed once a round too, under the key "beside"."""
    times = {label: [] for label in (*builds, "beside")}
    for i in range(warmup + rounds):
        for label, module in (list(builds.items()) if i % 2 else list(builds.items())[::-1]):
            _native_ops._C = module
            start = time.perf_counter()
            run()
            if i >= warmup:
                times[label].append(time.perf_counter() - start)
        if beside is not None:
            start = time.perf_counter()
            beside()
            if i >= warmup:
                times["beside"].append(time.perf_counter() - start)
    return times


def step_table(builds: dict, configs, rounds: int) -> None:
    print("step time over the non-private step's (minimum, median); median of paired differences")
    print(f"{'config':16s} {'old min':>8s} {'old med':>8s} {'new min':>8s} {'new med':>8s} {'new-old µs':>11s}")
    for config in configs:
        steps = build_steps(config)
        times = alternate(builds, steps["fastdp"], rounds, beside=steps["nonprivate"])
        lo, mid = min(times["beside"]), statistics.median(times["beside"])
        diff = statistics.median(n - o for o, n in zip(times["old"], times["new"]))
        print(f"{config:16s} {min(times['old']) / lo:8.3f} {statistics.median(times['old']) / mid:8.3f} "
              f"{min(times['new']) / lo:8.3f} {statistics.median(times['new']) / mid:8.3f} {1e6 * diff:+11.0f}",
              flush=True)


def calls_table(builds: dict, calls, rounds: int) -> None:
    """Per-call minimum of each build, alternated: ``calls`` yields (label, function)."""
    print(f"{'call':44s} {'old µs':>9s} {'new µs':>9s} {'new/old':>8s}  (minimum)")
    for label, run in calls:
        times = alternate(builds, run, rounds, warmup=5)
        old, new = (1e6 * min(times[k]) for k in ("old", "new"))
        print(f"{label:44s} {old:9.0f} {new:9.0f} {new / old:8.2f}", flush=True)


def conv_calls(batch: int = 64):
    """The fused conv kernel on the CNNs' layers, both routes."""
    for name, (shape, weight_shape, spec) in CONV_LAYERS.items():
        x = torch.randn(batch, *shape)
        g = torch.randn_like(torch.nn.functional.conv2d(x, torch.randn(weight_shape), None, spec.stride,
                                                        spec.padding))
        for route, ghost, keep in (("direct-keep", False, True), ("ghost", True, False)):
            yield (f"{name} {route} B={batch}",
                   lambda x=x, g=g, spec=spec, ghost=ghost, keep=keep: _native_ops.conv_sq_norms(
                       x, g, spec, ghost, keep_grads=keep, bias_grads=True))


LINEAR_CALLS = ((32, 128, 256, 256), (32, 128, 256, 768), (32, 128, 256, 1024), (32, 128, 1024, 256),
                (32, 128, 256, 10000), (2, 512, 4096, 4096))  # the transformer's and the wide linear's shapes


def linear_calls():
    """The linear ghost and direct norms at the transformer's and the wide linear's shapes (float32)."""
    for b, t, d, p in LINEAR_CALLS:
        a, g = torch.randn(b, t, d), torch.randn(b, t, p)
        for op in ("linear_sq_norms_ghost", "linear_sq_norms_direct"):
            yield f"{op[16:]} B{b} T{t} d{d} p{p}", lambda a=a, g=g, fn=getattr(_native_ops, op): fn(a, g)


def noise_calls():
    """The noise kernel in place (as the optimizer calls it) on one tensor."""
    for n in (1 << 20, 8_400_000):
        s = [torch.randn(n)]
        yield f"noise in place {n / 1e6:.1f}M", lambda s=s: _native_ops.noisy_average(s, 1.0, 1.0, 7, inplace=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the baseline build of fastdp._C (a .so file)")
    parser.add_argument("new", help="the build to compare with it")
    parser.add_argument("--configs", default="mnist-cnn-b64,mnist-cnn-b256,cifar-cnn-gn")
    parser.add_argument("--rounds", type=int, help="alternations of the two builds (default 300 steps, 30 calls)")
    parser.add_argument("--calls", choices=("conv", "linear", "noise"),
                        help="time one kernel's calls instead of engine steps")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in bench.CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {list(bench.CONFIGS)}")
    builds = load_builds(args.old, args.new)
    print(f"torch {torch.__version__}, {args.threads} threads")
    if args.calls:
        calls_table(builds, {"conv": conv_calls, "linear": linear_calls, "noise": noise_calls}[args.calls](),
                    args.rounds or 30)
    else:
        step_table(builds, configs, args.rounds or 300)


if __name__ == "__main__":
    main()
