"""``fastdp bench``: the cost of a DP-SGD step against a non-private step, for fastdp and peers.

For every configuration (model, batch) and method, one fresh subprocess builds the model
and data from a fixed seed, warms up, times steps and records its peak memory, so that
neither warm-up nor allocator state leaks from one method into the next. Each method is
reported as a ratio to the non-private step measured in the same run.

Methods: ``nonprivate`` (plain autograd + SGD), ``fastdp-<backend>`` (one backward pass,
``FASTDP_BACKEND`` set in the subprocess; ``auto`` is the default per-op choice), ``loop``
(one backward per sample, clip, sum, noise), ``vmap`` (``torch.func`` per-sample
gradients), ``opacus-hooks`` and
``opacus-ghost`` (Opacus' two-backward ghost clipping), ``bf16-nonprivate`` and
``bf16-fastdp`` (the step under bfloat16 autocast), ``ddp2-fastdp`` (two gloo processes on
halves of the same global batch, ``DistributedDPOptimizer``). All use sigma = 1, C = 1, SGD,
and keep freed memory for reuse (:func:`fastdp.allocator.keep_freed_memory`), as ``fastdp
train`` does.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.allocator import keep_freed_memory
from fastdp.cli import positive_float, positive_int

NOISE_MULTIPLIER = 1.0
MAX_GRAD_NORM = 1.0
LR = 1e-3
SEED = 0
RESULT_TAG = "FASTDP_BENCH_RESULT "
MEMORY_METHOD_CPU = (
    "peak RSS increase: VmHWM (reset via /proc/self/clear_refs) minus VmRSS after building "
    "model, data and optimizer, before the first step"
)
_CLOCKS = {"wall": "wall time", "cpu": "process CPU time (user + system, all threads)"}
MEMORY_METHOD_CUDA = "torch.cuda.max_memory_allocated() minus memory_allocated() before the first step"

# ----------------------------------------------------------------------------- models


class SampleLoss(nn.Module):
    """Batch mean of a per-sample loss; ``reduction="none"`` returns the per-sample losses
    (what Opacus' ghost clipping asks of a criterion)."""

    def __init__(self, per_sample: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.per_sample = per_sample
        self.reduction = "mean"

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        losses = self.per_sample(out, target)
        return losses if self.reduction == "none" else losses.mean()


def _ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _lm(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(y.shape[0], -1).mean(1)


def _sum_of_squares(out, y):
    return out.square().flatten(1).sum(1)


def mlp(widths):
    layers = []
    for i in range(len(widths) - 1):
        layers += [nn.Linear(widths[i], widths[i + 1]), nn.ReLU()]
    return nn.Sequential(nn.Flatten(), *layers[:-1])


def mnist_cnn(c1=16, c2=32, hidden=32):
    """Tramer & Boneh's tanh CNN for 1x28x28 inputs."""
    return nn.Sequential(
        nn.Conv2d(1, c1, 8, stride=2, padding=2), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Conv2d(c1, c2, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(c2 * 16, hidden), nn.Tanh(), nn.Linear(hidden, 10),
    )


def cifar_cnn(widths=(32, 64, 64, 128), groups=8):
    """Four 3x3 conv + GroupNorm + ReLU blocks (pooling after the first three), global pool, fc."""
    layers, c_in = [], 3
    for i, c in enumerate(widths):
        layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.GroupNorm(min(groups, c), c), nn.ReLU()]
        if i < len(widths) - 1:
            layers.append(nn.MaxPool2d(2))
        c_in = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, 10))


class Attention(nn.Module):
    """Causal multi-head self-attention from four ``nn.Linear`` projections."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(future, float("-inf")).softmax(-1)
        return self.o((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Pre-LN decoder-only transformer of Embedding, LayerNorm and Linear layers only."""

    def __init__(self, vocab: int, d: int, seq: int, layers: int, heads: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
        return self.head(self.ln(self.blocks(self.tok(ids) + self.pos(pos))))


def _images(batch, shape, classes=10):
    return torch.randn(batch, *shape), torch.randint(0, classes, (batch,))


def _mlp(q):
    return mlp((784, 32, 32, 10) if q else (784, 512, 512, 10)), *_images(8 if q else 256, (784,)), _ce


def _mnist(batch):
    return lambda q: (mnist_cnn(*((4, 8, 8) if q else ())), *_images(8 if q else batch, (1, 28, 28)), _ce)


def _cifar(q):
    model = cifar_cnn((8, 8, 8, 8) if q else (32, 64, 64, 128), groups=2 if q else 8)
    return model, *_images(4 if q else 128, (3, 32, 32)), _ce


def _transformer(q):
    vocab, d, seq, batch = (100, 16, 8, 4) if q else (10000, 256, 128, 32)
    ids = torch.randint(0, vocab, (batch, seq + 1))
    return TinyLM(vocab, d, seq, 2, 2 if q else 4), ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), _lm


def _wide(q):
    d, batch, seq = (64, 4, 8) if q else (4096, 16, 512)
    x = torch.randn(batch, seq, d) / math.sqrt(d)
    return nn.Linear(d, d), x, torch.zeros(batch), _sum_of_squares


CONFIGS: Dict[str, tuple] = {
    # name: (builder(quick) -> (model, x, y, per-sample loss), description)
    "mlp": (_mlp, "MLP 784-512-512-10, ReLU, B=256"),
    "mnist-cnn-b64": (_mnist(64), "Tramer-Boneh MNIST tanh CNN, B=64"),
    "mnist-cnn-b256": (_mnist(256), "Tramer-Boneh MNIST tanh CNN, B=256"),
    "cifar-cnn-gn": (_cifar, "CIFAR-10 CNN, 4 conv 32-64-64-128 + GroupNorm, B=128"),
    "transformer": (_transformer, "2-layer transformer LM, V=10000 d=256 T=128 B=32"),
    "wide-linear": (_wide, "Linear 4096->4096 on (16, 512, 4096), sum-of-squares loss"),
}

# ----------------------------------------------------------------------------- methods

METHODS = ("nonprivate", "fastdp-auto", "fastdp-reference", "fastdp-native", "fastdp-triton", "loop", "vmap",
           "opacus-hooks", "opacus-ghost", "bf16-nonprivate", "bf16-fastdp", "ddp2-fastdp")
DDP_WORLD = 2
_OPACUS_HINT = "Opacus is not installed: pip install 'fastdp[bench]' (opacus==1.6.0)"


def _plain_step(model, x, y, crit, opt):
    def step():
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    return step


def _noisy_grads(params, sums, batch):
    for p, s in zip(params, sums):
        p.grad = (s + torch.randn_like(s) * (NOISE_MULTIPLIER * MAX_GRAD_NORM)) / batch


def _clip_coefs(sq_norms):
    return (MAX_GRAD_NORM / (sq_norms.sqrt() + 1e-6)).clamp(max=1.0)


def _loop_step(model, x, y, crit, opt):
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        opt.zero_grad()
        sums = [torch.zeros_like(p) for p in params]
        for i in range(x.shape[0]):
            grads = torch.autograd.grad(crit(model(x[i:i + 1]), y[i:i + 1]), params)
            coef = _clip_coefs(sum(g.square().sum() for g in grads))
            for s, g in zip(sums, grads):
                s.add_(g * coef)
        _noisy_grads(params, sums, x.shape[0])
        opt.step()
    return step


def _vmap_step(model, x, y, crit, opt):
    from torch.func import functional_call, grad, vmap

    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())

    def sample_loss(params, xi, yi):
        return crit(functional_call(model, (params, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))

    def step():
        opt.zero_grad()
        grads = per_sample({n: p.detach() for n, p in named.items()}, x, y)
        coefs = _clip_coefs(sum(g.flatten(1).square().sum(1) for g in grads.values()))
        sums = [torch.einsum("b,b...->...", coefs, grads[n]) for n in named]
        _noisy_grads(list(named.values()), sums, x.shape[0])
        opt.step()
    return step


def _fastdp_optimizer(model, x, opt, loss_reduction="mean"):
    from fastdp import DPOptimizer

    return DPOptimizer(opt, module=model, noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM,
                       expected_batch_size=x.shape[0], seed=SEED, loss_reduction=loss_reduction)


def _fastdp_step(model, x, y, crit, opt):
    return _plain_step(model, x, y, crit, _fastdp_optimizer(model, x, opt))


def _fastdp_summed_step(model, x, y, crit, opt):
    """fastdp on the summed loss, which half-precision output gradients need (the step is the same)."""
    dp = _fastdp_optimizer(model, x, opt, loss_reduction="sum")
    return _plain_step(model, x, y, lambda out, target: crit(out, target) * x.shape[0], dp)


def _opacus_hooks_step(model, x, y, crit, opt):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    dp = DPOptimizer(opt, noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM,
                     expected_batch_size=x.shape[0], loss_reduction="mean")
    return _plain_step(gsm, x, y, crit, dp)


def _opacus_ghost_step(model, x, y, crit, opt):
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="mean",
                                               max_grad_norm=MAX_GRAD_NORM, use_ghost_clipping=True)
    dp = DPOptimizerFastGradientClipping(opt, noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM,
                                         expected_batch_size=x.shape[0], loss_reduction="mean")
    return _plain_step(gsm, x, y, DPLossFastGradientClipping(gsm, dp, crit, "mean"), dp)


def _bf16(builder):
    """The same step under ``torch.autocast`` with bfloat16 (fastdp accumulates in float32)."""
    def build(model, x, y, crit, opt):
        step = builder(model, x, y, crit, opt)

        def autocast_step():
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                step()
        return autocast_step
    return build


_STEP_BUILDERS = {
    "nonprivate": _plain_step, "loop": _loop_step, "vmap": _vmap_step,
    "opacus-hooks": _opacus_hooks_step, "opacus-ghost": _opacus_ghost_step,
    "bf16-nonprivate": _bf16(_plain_step), "bf16-fastdp": _bf16(_fastdp_summed_step),
}

# ----------------------------------------------------------------------------- worker


def _proc_status() -> Dict[str, int]:
    """VmRSS / VmHWM of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; True if the kernel honoured it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        status = _proc_status()
        return status["VmHWM"] <= status["VmRSS"] + (1 << 20)
    except OSError:
        return False


class _OpsRecorder:
    """Records which backend ``fastdp.ops`` dispatches each op to (the worker never uninstalls it)."""

    def __init__(self):
        self.used: Dict[str, str] = {}

    def install(self) -> "_OpsRecorder":
        from fastdp import ops

        original = ops.implementation

        def implementation(op, device):
            backend, fn = original(op, device)
            self.used[op] = backend
            return backend, fn
        ops.implementation = implementation
        return self


def measure(config: str, method: str, quick: bool, device: str, min_time: float, budget: float,
            threads: int, clock: str = "wall") -> dict:
    """Build, warm up, time and measure one (config, method) in this process."""
    keep_freed_memory()  # every method alike: see fastdp.allocator
    if method.startswith("ddp"):
        return _measure_ddp(config, quick, device, min_time, budget, threads, clock)
    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    model, x, y, per_sample = CONFIGS[config][0](quick)
    dev = torch.device(device)
    model, x, y, crit = model.to(dev), x.to(dev), y.to(dev), SampleLoss(per_sample)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    builder = _fastdp_step if method.startswith("fastdp-") else _STEP_BUILDERS[method]
    step = builder(model, x, y, crit, opt)
    recorder = _OpsRecorder().install() if "fastdp" in method else None
    result = _time_steps(step, dev, quick, min_time, budget, clock)
    if recorder is not None and "timeout" not in result:
        result["ops"] = recorder.used
    return result


def _time_steps(step, dev: torch.device, quick: bool, min_time: float, budget: float,
                clock: str, agree: Callable[[bool], bool] = lambda stop: stop) -> dict:
    """Warm up, time steps until ``min_time`` (or the budget) and read the peak memory.
    ``agree(stop)`` makes processes that step together (DDP ranks) stop at the same step."""
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
        base, reset = torch.cuda.memory_allocated(dev), True
    else:
        base, reset = _proc_status()["VmRSS"], _reset_peak_rss()
    start = time.perf_counter()
    times, cpu_times = [], []
    warmup = 1 if quick else 2
    max_steps = 3 if quick else 200
    min_steps = 2 if quick else 3
    while True:
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        sync()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        if len(times) == 1 and times[0] > budget / 6:
            warmup = 1  # slow steps: one warm-up step leaves the budget for timed ones
        timed = (times if clock == "wall" else cpu_times)[warmup:]
        elapsed = time.perf_counter() - start
        enough = len(timed) >= max_steps or (len(timed) >= min_steps and sum(timed) >= min_time)
        # Stop early when another step would overrun the budget, as long as one step is timed.
        over_budget = elapsed > budget if not timed else elapsed + statistics.median(timed) > budget
        if agree(enough or over_budget):
            if not timed:
                return {"timeout": f"{len(times)} warm-up step(s) took {elapsed:.0f} s > budget {budget:.0f} s"}
            break
    if cuda:
        peak = torch.cuda.max_memory_allocated(dev) - base
    else:
        peak = _proc_status()["VmHWM"] - base
    result = {
        "step_ms": 1e3 * statistics.median(timed),
        "step_ms_min": 1e3 * min(timed),
        "wall_ms": 1e3 * statistics.median(times[warmup:]),
        "cpu_ms": 1e3 * statistics.median(cpu_times[warmup:]),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "steps": len(timed),
        "warmup_steps": warmup,
        "peak_mb": peak / 2**20 if reset else None,
    }
    return result


def _ddp_rank(rank: int, port: int, config: str, quick: bool, min_time: float, budget: float,
              threads: int, clock: str, out_path: str) -> None:
    """One gloo rank: its slice of the global batch, DistributedDPOptimizer, timed steps."""
    import torch.distributed as dist

    from fastdp.distributed import DistributedDPOptimizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=DDP_WORLD)
    try:
        keep_freed_memory()
        torch.set_num_threads(max(1, threads // DDP_WORLD))
        torch.manual_seed(SEED)
        model, x, y, per_sample = CONFIGS[config][0](quick)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        dp = DistributedDPOptimizer(opt, module=model, noise_multiplier=NOISE_MULTIPLIER,
                                    max_grad_norm=MAX_GRAD_NORM, expected_batch_size=x.shape[0], seed=SEED)
        step = _plain_step(model, x[rank::DDP_WORLD], y[rank::DDP_WORLD], SampleLoss(per_sample), dp)

        def agree(stop: bool) -> bool:  # both ranks stop after the same step, or one waits forever
            flag = torch.tensor(float(stop))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return bool(flag)

        result = _time_steps(step, torch.device("cpu"), quick, min_time, budget, clock, agree)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # About one run in 40 a rank aborted after all of this, at interpreter exit, in C++
    # teardown ("terminate called without an active exception"), with or without a barrier
    # and whichever rank left first; its work and rank 0's result were complete. Leave
    # without the interpreter's teardown (only on success: errors above propagate).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _measure_ddp(config, quick, device, min_time, budget, threads, clock) -> dict:
    """fastdp data parallel on 2 CPU processes (gloo), each with half of the same global batch.
    Time is rank 0's per global step; memory is rank 0's (each rank holds a model replica)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    if device != "cpu":
        return {"timeout": "the DDP row runs on CPU (gloo) only"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.json")
        mp.spawn(_ddp_rank, args=(port, config, quick, min_time, budget, threads, clock, out_path),
                 nprocs=DDP_WORLD, join=True)
        with open(out_path) as f:
            return json.load(f)


def _worker(argv: List[str]) -> int:
    args = json.loads(argv[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = measure(**args)
    notes = sorted({str(w.message).splitlines()[0] for w in caught if "fastdp" in str(w.message)})
    result["warnings"] = notes
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0

# ----------------------------------------------------------------------------- driver


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _skip_reason(method: str, device: str) -> Optional[str]:
    if method.startswith("opacus-") and not _have("opacus"):
        return _OPACUS_HINT
    if method == "fastdp-triton" and (device != "cuda" or not _have("triton")):
        return "Triton kernels run on CUDA only" if device != "cuda" else "triton is not installed"
    return None


def _run_one(config: str, method: str, args) -> dict:
    row = {"config": config, "method": method}
    reason = _skip_reason(method, args.device)
    if reason:
        return {**row, "status": "skipped", "note": reason}
    env = dict(os.environ)
    if method.startswith("fastdp-"):
        env["FASTDP_BACKEND"] = method.split("-", 1)[1]
    payload = json.dumps({"config": config, "method": method, "quick": args.quick, "device": args.device,
                          "min_time": args.min_time, "budget": args.budget, "threads": args.threads,
                          "clock": args.clock})
    cmd = [sys.executable, "-c", "import sys, fastdp.bench as b; sys.exit(b._worker(sys.argv[1:]))", payload]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=2 * args.budget + 60)
    except subprocess.TimeoutExpired:
        return {**row, "status": "timeout", "note": f"no result within {2 * args.budget + 60:.0f} s"}
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            if "timeout" in result:
                return {**row, "status": "timeout", "note": result["timeout"]}
            return {**row, "status": "ok", **result}
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    status = "oom" if proc.returncode in (-9, 137) else "error"
    return {**row, "status": status, "note": tail[:200]}


def _backend_label(row: dict) -> str:
    ops_used = row.get("ops")
    if not ops_used:
        return ""
    return ", ".join(f"{op}:{b}" for op, b in sorted(ops_used.items()))


def _ratio_base(method: str) -> str:
    """The step a method's ratios are to: the non-private step in the same precision (bf16 autocast
    against bf16, so that bf16 DP is not credited with bf16's own speed), bf16-nonprivate itself
    against the float32 non-private step."""
    return "bf16-nonprivate" if method.startswith("bf16-") and method != "bf16-nonprivate" else "nonprivate"


def _add_ratios(rows: List[dict]) -> None:
    base = {(r["config"], r["method"]): r for r in rows
            if r["method"] in ("nonprivate", "bf16-nonprivate") and r["status"] == "ok"}
    for r in rows:
        b = base.get((r["config"], _ratio_base(r["method"])))
        if r.get("step_ms") is None or b is None:
            continue
        r["time_ratio"] = r["step_ms"] / b["step_ms"]
        if r.get("peak_mb") is not None and b.get("peak_mb"):
            r["mem_ratio"] = r["peak_mb"] / b["peak_mb"]


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(rows: List[dict], meta: dict) -> str:
    """The results as a markdown table, preceded by how they were measured."""
    lines = [
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; torch {meta['torch']}, {meta['device_name']}, {meta['threads']} threads, "
        f"load average before the run {meta['load_average_before']}.  ",
        f"Time: median per-step {_CLOCKS[meta['clock']]} after warm-up; ratio to the non-private step of the "
        "same config (bf16 methods: to bf16-nonprivate; bf16-nonprivate: to the float32 step).  ",
        f"Memory: {meta['memory_method']}; ratio to the same non-private step.  ",
        "Allocator: every method's process keeps freed memory for reuse (`fastdp.keep_freed_memory`).",
        "",
        "| config | method | backend (ops used) | step ms | × non-private | peak extra MiB | × non-private "
        "| load 1m | status |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        status = r["status"] if not r.get("note") else f"{r['status']} ({r['note']})"
        if r.get("warnings"):
            status += "; " + "; ".join(r["warnings"])
        lines.append(
            f"| {r['config']} | {r['method']} | {_backend_label(r)} | {_fmt(r.get('step_ms'), '.1f')} | "
            f"{_fmt(r.get('time_ratio'), '.2f')} | {_fmt(r.get('peak_mb'), '.1f')} | "
            f"{_fmt(r.get('mem_ratio'), '.2f')} | {_fmt(r.get('load_avg_1m'), '.1f')} | {status} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: List[dict], path: str) -> None:
    """Grouped bars of the time and memory ratios, one group per config (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "nonprivate"]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(configs)), 8), sharex=True)
    width = 0.8 / max(1, len(methods))
    for ax, key, label in ((axes[0], "time_ratio", "step time / non-private"),
                           (axes[1], "mem_ratio", "peak memory / non-private")):
        for j, m in enumerate(methods):
            vals = {r["config"]: r.get(key) for r in rows if r["method"] == m}
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(configs))]
            ax.bar(xs, [vals.get(c) or 0 for c in configs], width, label=m)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(label)
    axes[1].set_xticks(range(len(configs)), configs, rotation=15)
    axes[0].legend(ncol=4, fontsize=8)
    axes[0].set_title("DP-SGD cost relative to a non-private step (missing bar: skipped/timeout)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _command(args) -> str:
    """The ``fastdp bench`` command line that reproduces ``args``."""
    parts = ["fastdp bench"] + (["--quick"] if args.quick else [])
    for name in ("configs", "methods", "device", "threads", "clock", "min_time", "budget", "markdown", "json",
                 "plot"):
        value = getattr(args, name)
        if value is not None:
            parts.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(parts)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({len(names)} CPUs)"
    except (OSError, IndexError):
        return platform.machine()


def _default_methods(device: str) -> List[str]:
    """On CPU the default backend choice is ``native`` for every op, so ``fastdp-auto`` would
    repeat ``fastdp-native``; Triton runs on CUDA only."""
    return [m for m in METHODS if m not in ("fastdp-auto", "fastdp-triton") or device == "cuda"]


def _split(value: Optional[str], choices, what: str) -> Optional[List[str]]:
    if not value:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise SystemExit(f"fastdp bench: unknown {what} {', '.join(unknown)}; choose from {', '.join(choices)}")
    return names


def run(args) -> int:
    configs = _split(args.configs, list(CONFIGS), "config(s)") or list(CONFIGS)
    methods = _split(args.methods, METHODS, "method(s)")
    if methods and any(m.startswith("opacus-") for m in methods) and not _have("opacus"):
        raise SystemExit(f"fastdp bench: the requested Opacus methods need Opacus. {_OPACUS_HINT}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fastdp bench: --device cuda, but this torch sees no CUDA GPU (a CPU build, or no "
                         "device visible); use --device cpu")
    if args.clock == "cpu" and args.device == "cuda":
        raise SystemExit("fastdp bench: --clock cpu does not time CUDA kernels; use --clock wall on CUDA")
    if args.plot and not _have("matplotlib"):
        raise SystemExit("fastdp bench: --plot needs matplotlib: pip install 'fastdp[bench]'")
    methods = methods or _default_methods(args.device)
    methods = ["nonprivate"] + [m for m in methods if m != "nonprivate"]
    if args.min_time is None:
        args.min_time = 0.05 if args.quick else 1.0
    if args.budget is None:
        args.budget = 30.0 if args.quick else 90.0
    if args.threads is None:
        args.threads = 1 if args.quick else torch.get_num_threads()
    cuda = args.device == "cuda"
    meta = {
        "command": _command(args),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if cuda else _cpu_name(),
        "threads": args.threads,
        "load_average_before": [round(v, 2) for v in os.getloadavg()],
        "quick": args.quick,
        "noise_multiplier": NOISE_MULTIPLIER, "max_grad_norm": MAX_GRAD_NORM, "optimizer": f"SGD(lr={LR})",
        "memory_method": MEMORY_METHOD_CUDA if cuda else MEMORY_METHOD_CPU,
        "budget_s": args.budget, "min_time_s": args.min_time, "clock": args.clock,
    }
    rows = []
    for config in configs:
        for method in methods:
            row = _run_one(config, method, args)
            rows.append(row)
            print(f"[bench] {config:15s} {method:17s} {row['status']:8s} "
                  f"{_fmt(row.get('step_ms'), '.1f'):>9s} ms  {row.get('note', '')}", file=sys.stderr, flush=True)
    _add_ratios(rows)
    table = markdown(rows, meta)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "configs": {c: CONFIGS[c][1] for c in configs}, "results": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="time and memory of a DP-SGD step against a non-private step, for fastdp and peers",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--configs", help=f"comma-separated subset of: {', '.join(CONFIGS)}")
    p.add_argument("--methods", help=f"comma-separated subset of: {', '.join(METHODS)} (nonprivate always runs)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few steps (CI smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--min-time", type=positive_float, help="seconds of timed steps per method (default 1, quick 0.05)")
    p.add_argument("--budget", type=positive_float, help="seconds per method before it stops stepping (default 90, quick 30)")
    p.add_argument("--threads", type=positive_int, help="torch threads per measurement (default: torch's, quick 1)")
    p.add_argument("--clock", choices=tuple(_CLOCKS), default="wall",
                   help="time steps by wall clock (default) or by this process's CPU time (shared machines)")
    p.add_argument("--markdown", metavar="PATH", help="also write the markdown table here")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of the ratios here")
    p.set_defaults(func=run)
