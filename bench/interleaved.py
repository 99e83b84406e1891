"""Step-time ratio fastdp / non-private measured side by side in one process.

    .venv/bin/python bench/interleaved.py [--configs mlp,...] [--rounds 40] [--threads 2] [--fast-pool]

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


def fast_pools(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every ``nn.MaxPool2d(2, stride=1)`` replaced by fastdp's
    ``MaxPool2x2Stride1`` (same values and gradients; aten's pool is slow on CPU)."""
    from fastdp.train import MaxPool2x2Stride1

    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.MaxPool2d) and child.kernel_size in (2, (2, 2)) \
                and child.stride in (1, (1, 1)) and child.padding in (0, (0, 0)) and child.dilation in (1, (1, 1)):
            setattr(model, name, MaxPool2x2Stride1())
        else:
            fast_pools(child)
    return model


def _phased_step(model, x, y, crit, opt):
    """The step of ``bench._plain_step``, returning its (forward, backward, optimizer step) seconds."""
    def step():
        opt.zero_grad()
        start = time.perf_counter()
        loss = crit(model(x), y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        opt.step()
        return forward - start, backward - forward, time.perf_counter() - backward
    return step


def build_steps(config: str, quick: bool = False, fast_pool: bool = False, phases: bool = False):
    """The non-private and the fastdp step of ``config``, each on its own copy of one model;
    with ``phases`` each step returns its phase times (``_phased_step``)."""
    torch.manual_seed(bench.SEED)
    model, x, y, per_sample = bench.CONFIGS[config][0](quick)
    if fast_pool:
        model = fast_pools(model)
    crit = bench.SampleLoss(per_sample)
    steps = {}
    for name in ("nonprivate", "fastdp"):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=bench.LR)
        if phases:
            steps[name] = _phased_step(m, x, y, crit, bench._fastdp_optimizer(m, x, opt) if name == "fastdp" else opt)
        else:
            steps[name] = (bench._fastdp_step if name == "fastdp" else bench._plain_step)(m, x, y, crit, opt)
    return steps


def interleaved(config: str, rounds: int, warmup: int = 3, fast_pool: bool = False):
    steps = build_steps(config, fast_pool=fast_pool)
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
    parser.add_argument("--fast-pool", action="store_true",
                        help="replace nn.MaxPool2d(2, stride=1) by fastdp's MaxPool2x2Stride1 in both steps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as fastdp bench and fastdp train do; process-wide, so both steps alike
    print(f"torch {torch.__version__}, {args.threads} threads; ms per step, ratio fastdp / non-private")
    print(f"{'config':16s} {'rounds':>6s} {'nonpriv min':>11s} {'fastdp min':>10s} {'ratio min':>9s} "
          f"{'ratio median':>12s}")
    for config in args.configs.split(","):
        probe = interleaved(config, 1, warmup=1, fast_pool=args.fast_pool)
        rounds = max(5, min(args.rounds, int(60 / max(1e-3, sum(map(sum, probe.values()))))))
        t = interleaved(config, rounds, fast_pool=args.fast_pool)
        mins = {k: min(v) for k, v in t.items()}
        meds = {k: statistics.median(v) for k, v in t.items()}
        print(f"{config:16s} {rounds:6d} {1e3 * mins['nonprivate']:11.2f} {1e3 * mins['fastdp']:10.2f} "
              f"{mins['fastdp'] / mins['nonprivate']:9.2f} {meds['fastdp'] / meds['nonprivate']:12.2f}", flush=True)


if __name__ == "__main__":
    main()
