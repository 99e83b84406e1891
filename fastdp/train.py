"""``fastdp train``: train a small CNN end to end with DP-SGD at a target (epsilon, delta).

The run uses :func:`fastdp.make_private`: Poisson sampling with rate q = B / N, the noise
multiplier calibrated by the chosen accountant (tight PLD by default) so that the planned
``epochs * round(N / B)`` steps spend exactly the target epsilon, per-sample clipping to C.

    fastdp train --dataset fashion-mnist --target-epsilon 3 --delta 1e-5 --metrics-json out.json

The Fashion-MNIST defaults are Tramer & Boneh (ICLR 2021)'s end-to-end tanh CNN and
hyper-parameters (batch 2048, SGD lr 4 momentum 0.9, C = 0.1) with 30 epochs instead of 40:
the tight accountant leaves a smaller sigma for the same (epsilon, delta).
``--dataset digits`` (scikit-learn's 8x8 digits) is a seconds-long smoke run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from fastdp.accounting import UnreachableTargetError, available_accountants
from fastdp.allocator import keep_freed_memory
from fastdp.callers import user_stacklevel
from fastdp.cli import delta_float, momentum_float, nonnegative_int, positive_float, positive_int
from fastdp.datasets import DATASETS, DatasetNotFoundError, collate_pairs, load_dataset
from fastdp.privacy import make_private

METRIC_KEYS = ("test_accuracy", "epsilon", "delta", "noise_multiplier", "sample_rate", "steps",
               "accountant", "wall_seconds")

# Per-dataset defaults; a command-line value overrides each of them.
DEFAULTS: Dict[str, Dict[str, float]] = {
    "fashion-mnist": dict(epochs=30, batch_size=2048, lr=4.0, momentum=0.9, max_grad_norm=0.1),
    "digits": dict(epochs=10, batch_size=128, lr=2.0, momentum=0.9, max_grad_norm=0.1),
}
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


class TrainConfigError(ValueError):
    """A run that cannot start as configured (checked before any training)."""


@dataclass
class TrainConfig:
    """Everything one run needs; ``None`` fields take the dataset's defaults."""

    dataset: str = "fashion-mnist"
    target_epsilon: float = 3.0
    delta: float = 1e-5
    epochs: Optional[int] = None
    batch_size: Optional[int] = None
    lr: Optional[float] = None
    momentum: Optional[float] = None
    max_grad_norm: Optional[float] = None
    activation: str = "tanh"
    accountant: str = "pld"
    seed: int = 0  # model initialisation and --subset: public randomness
    dp_seed: Optional[int] = None  # noise and Poisson batches; None: OS entropy (keep it secret)
    subset: Optional[int] = None
    data_dir: Optional[str] = None
    progress: bool = True

    def resolved(self) -> "TrainConfig":
        """A copy with the dataset's defaults filled in."""
        if self.dataset not in DEFAULTS:
            raise TrainConfigError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(DATASETS)}")
        values = asdict(self)
        for key, value in DEFAULTS[self.dataset].items():
            if values[key] is None:
                values[key] = type(value)(value)
        return TrainConfig(**values)


@dataclass
class TrainResult:
    """Final metrics (the ``--metrics-json`` keys) and the per-epoch curve."""

    metrics: Dict[str, object]
    epochs: List[int] = field(default_factory=list)
    accuracy: List[float] = field(default_factory=list)
    epsilons: List[float] = field(default_factory=list)
    train_seconds: float = 0.0
    samples: int = 0


class _ShiftedMaxPoolFn(torch.autograd.Function):
    """2x2 stride-1 max pooling as two shifted maxima (columns, then rows). Backward sends
    each output's gradient to its window's first maximum in raster order, as
    ``nn.MaxPool2d`` does; autograd's own ``torch.maximum`` backward splits ties and costs
    several times more (compares, ``where``, ``masked_fill`` over every element)."""

    @staticmethod
    def forward(ctx, x):
        across = torch.maximum(x[..., :-1], x[..., 1:])  # (.., H, W-1): max of each horizontal pair
        ctx.save_for_backward(x, across)
        return torch.maximum(across[..., :-1, :], across[..., 1:, :])

    @staticmethod
    def backward(ctx, grad_out):
        x, across = ctx.saved_tensors
        to_lower = grad_out * (across[..., 1:, :] > across[..., :-1, :])  # the lower row won (ties: upper)
        grad_across = torch.zeros_like(across)
        grad_across[..., :-1, :] += grad_out - to_lower
        grad_across[..., 1:, :] += to_lower
        to_right = grad_across * (x[..., 1:] > x[..., :-1])  # the right column won (ties: left)
        grad_x = torch.zeros_like(x)
        grad_x[..., :-1] += grad_across - to_right
        grad_x[..., 1:] += to_right
        return grad_x


class MaxPool2x2Stride1(nn.Module):
    """``nn.MaxPool2d(2, stride=1)``, same values and gradients, several times faster on CPU
    (forward and backward of the Tramer-Boneh CNN's pools at B=2048: 23 ms against 50 ms
    for ``nn.MaxPool2d`` and 80 ms for plain shifted ``torch.maximum``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ShiftedMaxPoolFn.apply(x)


def build_model(input_shape: Tuple[int, ...], num_classes: int, activation: str = "tanh") -> nn.Module:
    """The CNN for an input shape: Tramer & Boneh's 28x28 CNN, or a smaller one for small images.

    28x28: conv 16@8x8 s2 p2, maxpool 2 s1, conv 32@4x4 s2, maxpool 2 s1, fc 32, fc classes.
    """
    act = ACTIVATIONS[activation]
    channels, height, width = input_shape
    if min(height, width) >= 28:
        features = nn.Sequential(
            nn.Conv2d(channels, 16, 8, stride=2, padding=2), act(), MaxPool2x2Stride1(),
            nn.Conv2d(16, 32, 4, stride=2), act(), MaxPool2x2Stride1(), nn.Flatten(),
        )
    else:
        features = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1), act(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), act(), nn.MaxPool2d(2), nn.Flatten(),
        )
    with torch.no_grad():
        flat = features(torch.zeros(1, *input_shape)).shape[1]
    return nn.Sequential(features, nn.Linear(flat, 32), act(), nn.Linear(32, num_classes))


@torch.no_grad()
def evaluate(model: nn.Module, dataset, batch_size: int = 2500) -> float:
    """Accuracy of ``model`` on ``dataset`` (a :class:`~fastdp.datasets.TensorPairs`)."""
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(dataset), batch_size):
        x = dataset.inputs[start:start + batch_size]
        y = dataset.labels[start:start + batch_size]
        correct += int((model(x).argmax(1) == y).sum())
    model.train(was_training)
    return correct / len(dataset)


def train(config: TrainConfig) -> TrainResult:
    """Run DP-SGD training as ``config`` says; returns metrics and the per-epoch curve."""
    started = time.perf_counter()
    cfg = config.resolved()
    if cfg.epochs <= 0 or cfg.batch_size <= 0:
        raise TrainConfigError(f"epochs and batch size must be positive, got {cfg.epochs} and {cfg.batch_size}")
    if cfg.data_dir is not None and cfg.dataset != "fashion-mnist":
        raise TrainConfigError(f"--data-dir is for fashion-mnist; {cfg.dataset} comes with scikit-learn")
    torch.manual_seed(cfg.seed)
    try:
        data = load_dataset(cfg.dataset, cfg.data_dir, cfg.subset, cfg.seed)
    except ValueError as exc:  # an argument the dataset cannot honour (--subset)
        raise TrainConfigError(str(exc)) from None
    n = len(data.train)
    if cfg.batch_size > n:
        raise TrainConfigError(f"batch size {cfg.batch_size} exceeds the {n} training examples "
                               "(the sample rate B/N must be at most 1)")
    if cfg.delta >= 1 / n:
        warnings.warn(f"delta={cfg.delta:g} is not below 1/N = {1 / n:.3g}: a mechanism that publishes one "
                      "random example outright meets such a delta; use delta << 1/N", UserWarning,
                      stacklevel=user_stacklevel())
    model = build_model(data.input_shape, data.num_classes, cfg.activation)
    base = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    loader = DataLoader(data.train, batch_size=cfg.batch_size, collate_fn=collate_pairs)
    try:
        model, optimizer, loader = make_private(
            module=model, optimizer=base, data_loader=loader, max_grad_norm=cfg.max_grad_norm,
            target_epsilon=cfg.target_epsilon, target_delta=cfg.delta, epochs=cfg.epochs,
            accountant=cfg.accountant, seed=cfg.dp_seed,
        )
    except UnreachableTargetError as exc:
        raise TrainConfigError(f"target epsilon {cfg.target_epsilon:g} cannot be met in {cfg.epochs} epochs at "
                               f"batch size {cfg.batch_size} with any noise ({exc}); raise --target-epsilon or "
                               "lower --epochs or --batch-size") from None
    try:  # as the first step would, before any data is trained on
        optimizer.check_noise_fits_parameters()
    except ValueError as exc:
        optimizer.detach()
        raise TrainConfigError(f"--max-grad-norm {cfg.max_grad_norm:g}: {exc}") from None
    steps_per_epoch = len(loader)
    result = TrainResult(metrics={})
    criterion = nn.CrossEntropyLoss()
    bar = tqdm(total=steps_per_epoch * cfg.epochs, disable=not cfg.progress, unit="step",
               desc=f"DP-SGD sigma={optimizer.noise_multiplier:.3f}")
    train_started = time.perf_counter()
    epsilon = 0.0
    model.train()
    for epoch in range(1, cfg.epochs + 1):
        for x, y in loader:
            optimizer.zero_grad()
            if len(y):
                loss = criterion(model(x), y)
                loss.backward()
                result.samples += len(y)
                bar.set_postfix(loss=f"{loss.item():.3f}", eps=f"{epsilon:.2f}",
                                samples_s=f"{result.samples / (time.perf_counter() - train_started):.0f}",
                                refresh=False)
            optimizer.step()  # an empty Poisson batch still adds noise and counts as a step
            bar.update()
        epsilon = optimizer.epsilon(cfg.delta)
        accuracy = evaluate(model, data.test)
        result.epochs.append(epoch)
        result.accuracy.append(accuracy)
        result.epsilons.append(epsilon)
        bar.set_postfix(eps=f"{epsilon:.2f}", test_acc=f"{accuracy:.4f}")
        if cfg.progress:
            bar.write(f"epoch {epoch}/{cfg.epochs}: test accuracy {100 * accuracy:.2f}%, "
                      f"epsilon {epsilon:.3f}, {time.perf_counter() - train_started:.0f} s")
    bar.close()
    result.train_seconds = time.perf_counter() - train_started
    result.metrics = {
        "test_accuracy": result.accuracy[-1],
        "epsilon": epsilon,
        "delta": cfg.delta,
        "noise_multiplier": optimizer.noise_multiplier,
        "sample_rate": optimizer.sample_rate,
        "steps": optimizer.steps,
        "accountant": cfg.accountant,
        "wall_seconds": time.perf_counter() - started,
    }
    return result


def save_plot(result: TrainResult, path: str, title: str = "") -> None:
    """Write a PNG of test accuracy and epsilon spent against epochs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax_acc = plt.subplots(figsize=(6, 4))
    ax_acc.plot(result.epochs, [100 * a for a in result.accuracy], color="tab:blue", marker=".")
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("test accuracy (%)", color="tab:blue")
    ax_eps = ax_acc.twinx()
    ax_eps.plot(result.epochs, result.epsilons, color="tab:red", linestyle="--")
    ax_eps.set_ylabel("epsilon spent", color="tab:red")
    ax_acc.set_title(title)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def _summary(cfg: TrainConfig, result: TrainResult) -> str:
    m = result.metrics
    rate = result.samples / result.train_seconds if result.train_seconds > 0 else float("nan")
    return "\n".join([
        f"dataset {cfg.dataset}: test accuracy {100 * m['test_accuracy']:.2f}%",
        f"privacy: epsilon {m['epsilon']:.4f} at delta {m['delta']:g} ({m['accountant']} accountant)",
        f"sigma {m['noise_multiplier']:.4f}, q {m['sample_rate']:.6f}, {m['steps']} steps, "
        f"C {cfg.max_grad_norm:g}, batch {cfg.batch_size}, lr {cfg.lr:g}, momentum {cfg.momentum:g}",
        f"wall time {m['wall_seconds']:.1f} s (training loop {result.train_seconds:.1f} s with the "
        f"per-epoch test and accounting, {rate:.0f} training samples/s)",
    ])


def _check_writable(flag: str, path: str) -> None:
    """Create ``path``'s directory and check that a file can be written there, or exit naming ``flag``."""
    if path.endswith(os.sep) or (os.altsep and path.endswith(os.altsep)):
        raise SystemExit(f"fastdp train: {flag} {path}: a directory; give a file path")
    if flag == "--plot" and os.path.splitext(path)[1].lower() not in ("", ".png"):
        raise SystemExit(f"fastdp train: --plot {path}: the plot is a PNG; give a path ending in .png")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"fastdp train: {flag} {path}: cannot create its directory ({exc.strerror})") from None
    if os.path.isdir(path) or not os.access(directory, os.W_OK):
        raise SystemExit(f"fastdp train: {flag} {path}: not a writable file path")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fastdp train``."""
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("fastdp train: --plot needs matplotlib: pip install matplotlib") from None
    for flag, path in (("--metrics-json", args.metrics_json), ("--plot", args.plot)):
        if path:  # found unwritable now, not after the whole run
            _check_writable(flag, path)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    config = TrainConfig(
        dataset=args.dataset, target_epsilon=args.target_epsilon, delta=args.delta, epochs=args.epochs,
        batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
        max_grad_norm=args.max_grad_norm, activation=args.activation, accountant=args.accountant,
        seed=args.seed, dp_seed=args.dp_seed, subset=args.subset, data_dir=args.data_dir,
        progress=not args.no_progress,
    )
    if args.dp_seed is not None:
        print("fastdp train: --dp-seed makes the noise and the batches reproducible; epsilon holds only "
              "while that seed stays secret (leave --dp-seed out for a release)", file=sys.stderr)
    try:
        result = train(config)
    except (DatasetNotFoundError, TrainConfigError) as exc:
        raise SystemExit(f"fastdp train: {exc}") from None
    print(_summary(config.resolved(), result))
    if args.metrics_json:
        with open(args.metrics_json, "w") as f:
            json.dump({key: result.metrics[key] for key in METRIC_KEYS}, f, indent=2)
            f.write("\n")
    if args.plot:
        save_plot(result, args.plot, f"DP-SGD on {args.dataset}, "
                                     f"eps={result.metrics['epsilon']:.2f}, delta={args.delta:g}")
    return 0


def register(subparsers) -> None:
    """Add the ``train`` command to the ``fastdp`` command line."""
    p = subparsers.add_parser(
        "train", help="train a CNN with DP-SGD at a target (epsilon, delta)",
        description="Train a small CNN with DP-SGD (Poisson sampling, per-sample clipping, noise "
                    "calibrated to the target epsilon) and report its test accuracy.",
    )
    p.add_argument("--dataset", choices=DATASETS, default="fashion-mnist")
    p.add_argument("--target-epsilon", type=positive_float, default=3.0)
    p.add_argument("--delta", type=delta_float, default=1e-5)
    p.add_argument("--epochs", type=positive_int, help="default: 30 (fashion-mnist), 10 (digits)")
    p.add_argument("--batch-size", type=positive_int, help="expected (Poisson) batch size; default 2048 / 128")
    p.add_argument("--lr", type=positive_float, help="SGD learning rate; default 4 / 2")
    p.add_argument("--momentum", type=momentum_float, help="SGD momentum; default 0.9")
    p.add_argument("--max-grad-norm", type=positive_float, help="clipping bound C; default 0.1")
    p.add_argument("--activation", choices=sorted(ACTIVATIONS), default="tanh")
    p.add_argument("--accountant", choices=available_accountants(), default="pld",
                   help="privacy accountant: pld (tight, default) or rdp")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seeds the model's initial weights and --subset")
    p.add_argument("--dp-seed", type=nonnegative_int, help="seeds the noise and the Poisson batches, for reproducible "
                                               "experiments; default: OS entropy, as a private release needs")
    p.add_argument("--subset", type=positive_int, help="train on this many training examples only")
    p.add_argument("--data-dir", help="directory of the Fashion-MNIST IDX files "
                                      "(default /usr/share/datasets/fashion-mnist)")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--metrics-json", metavar="PATH", help="write the final metrics as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of test accuracy and epsilon per epoch")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
