"""``make_private``: the one-call switch from a non-private training set-up (Opacus-style)."""
from __future__ import annotations

import math
import warnings
from typing import Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader

from fastdp.arguments import finite_number
from fastdp.callers import user_stacklevel
from fastdp.data import partial_sampler, poisson_loader, steps_per_epoch
from fastdp.optimizer import DPOptimizer


# Opacus make_private / make_private_with_epsilon arguments that have no fastdp counterpart, with the fix.
_OPACUS_ONLY = {
    "grad_sample_mode": "fastdp has one mode (norms and clipped sums in the one backward pass); "
                        "remove it",
    "criterion": "fastdp needs no wrapped loss (one backward of the plain loss); remove it",
    "batch_first": "fastdp takes dim 0 of every layer input as the batch; permute the inputs "
                   "to put the batch first",
    "noise_generator": "pass seed= (or secure_mode=True) instead of a generator",
    "total_steps": "give epochs= with target_epsilon (steps = epochs x round(1 / q))",
    "wrap_model": "fastdp hooks the module in place and returns it (no wrapper); remove it",
    "rand_on_empty": "fastdp's Poisson loader hands an empty batch out as tensors of 0 samples; remove it",
}
_OPACUS_AS_FASTDP = {"batch_first": lambda value: bool(value), "noise_generator": lambda value: value is None}


def make_private(
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: DataLoader,
    max_grad_norm: float,
    noise_multiplier: Optional[float] = None,
    target_epsilon: Optional[float] = None,
    target_delta: Optional[float] = None,
    epochs: Optional[float] = None,
    poisson_sampling: bool = True,
    accountant: str = "pld",
    seed: Optional[int] = None,
    secure_mode: bool = False,
    **optimizer_kwargs,
) -> Tuple[nn.Module, DPOptimizer, DataLoader]:
    """Return ``(module, optimizer, data_loader)`` ready for DP-SGD.

    The sample rate is ``q = data_loader.batch_size / len(dataset)``; the expected batch
    size ``q N`` divides the noisy sum. Give either ``noise_multiplier`` or
    ``target_epsilon`` + ``target_delta`` + ``epochs`` (sigma is then calibrated with
    ``accountant`` for ``ceil(epochs * round(1 / q))`` steps, the Poisson loader running
    ``round(1 / q)`` steps per epoch). The returned optimizer carries the
    accountant: ``optimizer.accountant.epsilon(delta)`` or ``optimizer.epsilon(delta)``.

    ``poisson_sampling=False`` keeps the loader's shuffled fixed-size batches, which the
    Poisson-subsampled Gaussian analysis does NOT cover: the epsilon reported is then
    not a proven guarantee.

    ``secure_mode=True`` draws batches and noise from OS entropy every step (see
    :mod:`fastdp.secure`); it excludes ``seed``.
    """
    from fastdp import accounting

    for name, same in _OPACUS_AS_FASTDP.items():  # Opacus values that say what fastdp does anyway
        if name in optimizer_kwargs and same(optimizer_kwargs[name]):
            del optimizer_kwargs[name]
    opacus_only = sorted(set(optimizer_kwargs) & set(_OPACUS_ONLY))
    if opacus_only:
        raise TypeError(f"make_private got Opacus argument(s) {opacus_only} that fastdp does not take: "
                        + "; ".join(f"{name}={optimizer_kwargs[name]!r}: {_OPACUS_ONLY[name]}"
                                    for name in opacus_only))
    dataset_size = len(data_loader.dataset)
    batch_size = data_loader.batch_size
    if not batch_size:
        raise ValueError(
            f"make_private needs a data loader with a batch_size (this {type(data_loader).__name__} has none: built "
            "with batch_sampler=, e.g. Opacus' DPDataLoader?): pass a plain DataLoader(dataset, batch_size=...), "
            "whose batch_size / len(dataset) is the sample rate; fastdp does the Poisson sampling itself")
    if dataset_size == 0:
        raise ValueError("make_private needs a data loader over a non-empty dataset")
    if batch_size > dataset_size:
        raise ValueError(f"the loader's batch_size {batch_size} exceeds its dataset's {dataset_size} examples: "
                         "the sample rate batch_size / N must be at most 1; lower the batch_size")
    part = None if poisson_sampling else partial_sampler(data_loader)  # poisson_loader refuses any own sampler
    if part is not None:
        raise ValueError(f"the loader draws batches from part of its dataset ({part}): the sample rate "
                         "batch_size / len(dataset) would understate how often an example is used; give a "
                         "loader over the examples to train on (torch.utils.data.Subset for a split)")
    sample_rate = batch_size / dataset_size
    # Poisson: round(1/q) batches make an epoch; the loader's own fixed-size batches otherwise
    epoch_steps = steps_per_epoch(sample_rate) if poisson_sampling else len(data_loader)
    if poisson_sampling:  # before calibrating: it refuses a loader whose own sampler it would ignore
        data_loader = poisson_loader(data_loader, sample_rate, epoch_steps, seed, secure_mode)
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError("give exactly one of noise_multiplier or target_epsilon (with target_delta, epochs)")
    if target_epsilon is None and (target_delta is not None or epochs is not None):
        warnings.warn("target_delta and epochs only calibrate the noise for a target_epsilon: with noise_multiplier "
                      "given they are ignored (ask the accountant for epsilon at your delta: optimizer.epsilon(delta))",
                      UserWarning, stacklevel=user_stacklevel())
    if target_epsilon is not None:
        if target_delta is None or epochs is None:
            raise ValueError("target_epsilon needs target_delta and epochs to calibrate the noise")
        epochs = finite_number(epochs, "epochs (how long you will train, which calibrating the noise needs)")
        steps = int(math.ceil(epochs * epoch_steps))
        noise_multiplier = accounting.calibrate_noise(
            target_epsilon=target_epsilon, delta=target_delta, sample_rate=sample_rate,
            steps=steps, accountant=accountant,
        )
    if not poisson_sampling:
        warnings.warn(
            "poisson_sampling=False: shuffled fixed-size batches are not covered by the "
            "Poisson-subsampled Gaussian analysis; the reported epsilon is not a guarantee",
            UserWarning, stacklevel=user_stacklevel(),
        )
    privacy_accountant = accounting.make_accountant(accountant)  # an unknown name: refused before any hook
    dp_optimizer = DPOptimizer(
        optimizer, module=module, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
        expected_batch_size=batch_size, seed=seed, secure_mode=secure_mode, **optimizer_kwargs,
    )
    try:
        dp_optimizer.attach_accountant(privacy_accountant, sample_rate)
        if poisson_sampling:
            dp_optimizer.attach_loader(data_loader)  # one Poisson batch per step, checked at each step
    except Exception:
        dp_optimizer.detach()  # leave the module as it was given
        raise
    return module, dp_optimizer, data_loader
