"""Per-step host overhead of the fastdp step: its time minus the non-private step's on the
benchmark models' tiny ``--quick`` shapes, where the kernels cost next to nothing.

    .venv/bin/python bench/host_overhead.py [--configs mlp,mnist-cnn-b64] [--rounds 400] [--full]

``--full`` times the benchmark's full shapes instead: there the overhead includes the kernels.

Both steps are built from the same model in one process and alternated (as in
``interleaved.py``); medians of each phase (forward, backward, optimizer step) in µs.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from fastdp.allocator import keep_freed_memory
from interleaved import build_steps  # bench/ is on sys.path when run as a script

PHASES = ("forward", "backward", "step")


def phase_times(config: str, rounds: int, warmup: int = 20, quick: bool = True):
    steps = build_steps(config, quick=quick, phases=True)
    times = {(name, phase): [] for name in steps for phase in PHASES}
    for i in range(warmup + rounds):
        for name, step in (steps.items() if i % 2 else reversed(steps.items())):
            for phase, elapsed in zip(PHASES, step()):
                if i >= warmup:
                    times[(name, phase)].append(elapsed)
    return {key: statistics.median(v) for key, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="mlp,mnist-cnn-b64")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="the full shapes, not --quick's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    shapes = "full" if args.full else "--quick"
    print(f"torch {torch.__version__}, {args.threads} threads; {shapes} shapes, median µs per phase")
    print(f"{'config':16s} {'phase':9s} {'nonprivate':>10s} {'fastdp':>8s} {'overhead':>8s}")
    for config in args.configs.split(","):
        med = phase_times(config, args.rounds, quick=not args.full)
        for phase in PHASES + ("total",):
            if phase == "total":
                plain, dp = (sum(med[(n, p)] for p in PHASES) for n in ("nonprivate", "fastdp"))
            else:
                plain, dp = med[("nonprivate", phase)], med[("fastdp", phase)]
            print(f"{config:16s} {phase:9s} {1e6 * plain:10.1f} {1e6 * dp:8.1f} {1e6 * (dp - plain):8.1f}", flush=True)


if __name__ == "__main__":
    main()
