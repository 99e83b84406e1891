"""Checkpoints of a DP-SGD run that never restart epsilon.

One dictionary holds the model, the :class:`~fastdp.DPOptimizer` (wrapped optimizer's
state, step count, accountant history, noise seeds drawn) and the Poisson loader's
position::

    fastdp.checkpoint.save("run.pt", model=model, optimizer=opt, data_loader=loader)
    ...  # later, with freshly built objects of the same shapes:
    fastdp.checkpoint.load("run.pt", model=model, optimizer=opt, data_loader=loader)

``data_loader`` defaults to the loader the optimizer steps on (``make_private``'s), so the
loader's position is never left behind: a loader resumed at its first batch with the run's
seed would repeat the run's batches while the accountant counted them as fresh. Loading with
``data_loader=False`` leaves the loader as it is (resuming over another dataset); a
:class:`~fastdp.data.BatchMemoryManager` stands for its loader; a saved position with no
loader given or attached is refused. A load that is refused changes nothing; one that is
accepted drops clipped sums not yet stepped (a rollback between ``backward()`` and ``step()``).

The noise key and the sampler's seed are secret: with them anyone holding the file can
regenerate every step's noise and batches, and subtract the noise. They are left out
unless ``include_secrets=True``, so a checkpoint can be shared like the model. Training
from the loaded state gives the same parameters, bit for bit, as not stopping when the
fresh objects were given the run's seeds (``seed=``) or the file holds the secrets;
otherwise the resumed run draws its own noise and batches, as private but not identical
(secure mode draws them from OS entropy anyway). Saving between
``backward()`` and ``step()`` is refused: clipped sums not yet stepped are not stored.
Resuming with another ``noise_multiplier`` is allowed (with a warning): the restored
history keeps the old sigma's steps and the accountant appends the new ones.
In data-parallel runs save on rank 0 and load on every rank, at any number of ranks: ranks
other than 0 keep no accountant and skip its history.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict

import torch
from torch import nn

from fastdp.callers import user_stacklevel

FORMAT = "fastdp.checkpoint/2"  # /1 kept the accountant beside the optimizer's state; still read


class CheckpointMismatchError(ValueError):
    """The checkpoint does not belong to this model (parameter names or shapes differ)."""


def state_dict(*, model: nn.Module, optimizer, data_loader=None, include_secrets: bool = False) -> Dict[str, Any]:
    """Everything needed to resume: model, optimizer (with the accountant) and loader state;
    the noise key and sampler seed only with ``include_secrets`` (never publish that)."""
    if optimizer.engine.summed:
        if optimizer._logical_batch_open or optimizer._skip_next_step:  # a BatchMemoryManager chunk's step kept them
            raise RuntimeError("a BatchMemoryManager logical batch is open: its chunks' clipped sums wait for its last "
                               "chunk's step(), and zero_grad() keeps them; checkpoint after that step (when "
                               "optimizer.steps goes up) or before the first chunk's backward()")
        raise RuntimeError("clipped gradients are pending (backward() ran since the last step()): "
                           "checkpoint after optimizer.step() or zero_grad()")
    if optimizer.resumable_failed_step():
        raise RuntimeError("the last step() raised part-way, neither undone nor finished, which a checkpoint "
                           "cannot hold: retry step(), or give the step up with zero_grad(), then checkpoint")
    if data_loader is False:  # as load takes it: no loader position
        data_loader = None
    elif data_loader is None:
        data_loader = optimizer.loader
    data_loader = _poisson_loader(data_loader)
    loader_state = None
    if data_loader is not None:
        loader_state = data_loader.state_dict(include_secrets)
        ledger = data_loader.ledger
        if data_loader is optimizer.loader and not optimizer.engine.step_batches and ledger.taken > ledger.stepped_at:
            # taken since the last step and not trained on yet (a save at the top of the loop body): the
            # resumed run draws it again, as the uninterrupted run goes on to train on it. Only an attached
            # loader's steps are known (attach_loader)
            loader_state["position"] = ledger.stepped_at
    return {
        "format": FORMAT,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(include_secrets),
        "noise_multiplier": optimizer.noise_multiplier,
        "data_loader": loader_state,
    }


def _poisson_loader(data_loader):
    """The loader whose position a checkpoint keeps: a BatchMemoryManager's own loader; refuses a
    loader without one (``torch``'s ``DataLoader`` keeps no position)."""
    from fastdp.data import BatchMemoryManager

    if isinstance(data_loader, BatchMemoryManager):
        data_loader = data_loader.data_loader
    if data_loader is not None and not hasattr(data_loader, "check_state_dict"):
        raise TypeError(f"data_loader must be the run's fastdp Poisson loader (make_private's, or "
                        f"fastdp.poisson_loader's), whose position a checkpoint keeps; got {type(data_loader).__name__}")
    return data_loader


def _check_model(saved: Dict[str, torch.Tensor], model: nn.Module) -> None:
    current = model.state_dict()
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    shapes = [f"{k}: checkpoint {tuple(saved[k].shape)}, model {tuple(v.shape)}"
              for k, v in current.items() if k in saved and saved[k].shape != v.shape]
    if missing or unexpected or shapes:
        problems = [f"{label}: {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}"
                    for label, items in (("missing from the checkpoint", missing),
                                         ("not in the model", unexpected),
                                         ("shape mismatch", shapes)) if items]
        raise CheckpointMismatchError("the checkpoint is from another model; " + "; ".join(problems))


def load_state_dict(state: Dict[str, Any], *, model: nn.Module, optimizer, data_loader=None) -> None:
    """Restore what :func:`state_dict` saved into freshly built ``model``/``optimizer``/``data_loader``
    (default: the optimizer's loader; ``False``: leave the loader alone)."""
    if not isinstance(state, dict) or state.get("format") not in (FORMAT, "fastdp.checkpoint/1"):
        raise ValueError(f"not a fastdp checkpoint (expected format {FORMAT!r})")
    _check_model(state["model"], model)
    optimizer_state = state["optimizer"]
    if "accountant" in state:  # format /1
        optimizer_state = dict(optimizer_state, accountant=state["accountant"])
    if data_loader is False:
        data_loader = None
    elif data_loader is not None and state["data_loader"] is None:
        raise ValueError("the checkpoint has no data loader state to restore")
    elif data_loader is None and state["data_loader"] is not None:
        if optimizer.loader is None:
            raise ValueError(
                "the checkpoint holds the data loader's position but no loader was given and the optimizer has "
                "none attached: pass data_loader= (the run's Poisson loader; resumed at its first batch with the "
                "run's seed it would repeat the run's batches, counted as fresh), or data_loader=False to leave "
                "loaders as they are")
        data_loader = optimizer.loader
    elif data_loader is None and optimizer.loader is not None:
        warnings.warn("the checkpoint holds no loader position: the optimizer's loader goes on from where it "
                      "is, and if it was built with the run's seed it repeats the run's batches (the accountant "
                      "would count them as fresh); build it with a fresh seed", UserWarning,
                      stacklevel=user_stacklevel())
    data_loader = _poisson_loader(data_loader)
    if data_loader is not None:  # refused before anything changes
        data_loader.check_state_dict(state["data_loader"])

    optimizer.load_state_dict(optimizer_state)  # refuses a history it cannot continue, changing nothing
    model.load_state_dict(state["model"])
    if data_loader is not None:
        data_loader.load_state_dict(state["data_loader"])
    if state["noise_multiplier"] != optimizer.noise_multiplier:
        warnings.warn(f"resuming with noise_multiplier={optimizer.noise_multiplier} (checkpoint: "
                      f"{state['noise_multiplier']}); the accountant composes the steps of both",
                      UserWarning, stacklevel=user_stacklevel())


def save(path, *, model: nn.Module, optimizer, data_loader=None, include_secrets: bool = False) -> None:
    torch.save(state_dict(model=model, optimizer=optimizer, data_loader=data_loader,
                          include_secrets=include_secrets), path)


def load(path, *, model: nn.Module, optimizer, data_loader=None, map_location=None) -> None:
    state = torch.load(path, map_location=map_location, weights_only=True)
    load_state_dict(state, model=model, optimizer=optimizer, data_loader=data_loader)
