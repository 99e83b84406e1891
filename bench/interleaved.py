"""Step-time ratio fastdp / non-private measured side by side in one process.

    .venv/bin/python bench/interleaved.py [--configs mlp,...] [--rounds 40] [--threads 2]

``fastdp bench`` runs every method in a fresh subprocess, one after the other, so load that
drifts on a shared host moves whole rows (±30 % seen here). This script builds both steps
from the same model in one process and alternates them step by step, so drift hits both
alike; it reports the ratio of the minimum and of the median step time. Memory is not
measured here (``fastdp bench`` does it per process).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from fastdp import bench
from fastdp.allocator import keep_freed_memory


def interleaved(config: str, rounds: int, warmup: int = 3):
    torch.manual_seed(bench.SEED)
    model, x, y, per_sample = bench.CONFIGS[config][0](False)
    crit = bench.SampleLoss(per_sample)
    steps = {}
    for name, builder in (("nonprivate", bench._plain_step), ("fastdp", bench._fastdp_step)):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=bench.LR)
        steps[name] = builder(m, x, y, crit, opt)
    times = {name: [] for name in steps}
    for i in range(warmup + rounds):
        for name, step in (steps.items() if i % 2 else reversed(steps.items())):  # alternate the order too
            start = time.perf_counter()
            step()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(bench.CONFIGS))
    parser.add_argument("--rounds", type=int, default=40, help="timed steps of each (fewer for slow configs)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as fastdp bench and fastdp train do; process-wide, so both steps alike
    print(f"torch {torch.__version__}, {args.threads} threads; ms per step, ratio fastdp / non-private")
    print(f"{'config':16s} {'rounds':>6s} {'nonpriv min':>11s} {'fastdp min':>10s} {'ratio min':>9s} "
          f"{'ratio median':>12s}")
    for config in args.configs.split(","):
        probe = interleaved(config, 1, warmup=1)
        rounds = max(5, min(args.rounds, int(60 / max(1e-3, sum(map(sum, probe.values()))))))
        t = interleaved(config, rounds)
        mins = {k: min(v) for k, v in t.items()}
        meds = {k: statistics.median(v) for k, v in t.items()}
        print(f"{config:16s} {rounds:6d} {1e3 * mins['nonprivate']:11.2f} {1e3 * mins['fastdp']:10.2f} "
              f"{mins['fastdp'] / mins['nonprivate']:9.2f} {meds['fastdp'] / meds['nonprivate']:12.2f}", flush=True)


if __name__ == "__main__":
    main()
