"""Independent references for the engine's tests: a per-example loop on a plain copy of the model."""
from __future__ import annotations

import copy
import os
from typing import Callable, Dict, List, Sequence

import torch
from torch import nn

import fastdp
from fastdp.clipping import EPS


def examples(default: int) -> int:
    """Hypothesis examples per test; FASTDP_EXAMPLES lowers it for slow (interpreted) backends."""
    return min(default, int(os.environ.get("FASTDP_EXAMPLES", default)))


def sample_loss(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-sample losses (B,): a random linear term plus a quadratic one, any output shape."""
    out = out.to(weights.dtype)
    return (out * weights).flatten(1).sum(1) + 0.1 * out.square().flatten(1).sum(1)


def per_example_grads(model: nn.Module, inputs: Sequence[torch.Tensor], weights: torch.Tensor,
                      params: List[str]) -> Dict[str, torch.Tensor]:
    """{name: (B, *shape)} gradients of each example's own loss, one backward per example."""
    model = copy.deepcopy(model)
    named = dict(model.named_parameters(remove_duplicate=False))
    batch = inputs[0].shape[0]
    out = {n: [] for n in params}
    for i in range(batch):
        model.zero_grad(set_to_none=False)
        for p in model.parameters():
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        loss = sample_loss(model(*[x[i : i + 1] for x in inputs]), weights[i : i + 1]).sum()
        loss.backward()
        for n in params:
            out[n].append(named[n].grad.detach().clone())
    return {n: torch.stack(v) if v else None for n, v in out.items()}


def clipped_sum_reference(model, inputs, weights, max_grad_norm, params, mode="flat", gamma=0.01):
    """({name: sum_i c_i g_i}, {name: |g_i|^2 (B,)}, {name: sum_i |c_i g_i|}) with the engine's
    coefficient formula, from the per-example loop; the last is the scale of each sum's rounding."""
    grads = per_example_grads(model, inputs, weights, params)
    sq = {n: g.flatten(1).square().sum(1) for n, g in grads.items()}
    if mode == "per_layer":
        bounds = max_grad_norm if isinstance(max_grad_norm, (list, tuple)) else [max_grad_norm / len(params) ** 0.5] * len(params)
        coefs = {n: (c / (sq[n].sqrt() + EPS)).clamp(max=1.0) for n, c in zip(params, bounds)}
    else:
        total = torch.stack(list(sq.values())).sum(0).sqrt()
        if mode == "automatic":
            c = max_grad_norm / (total + gamma)
        else:
            c = (max_grad_norm / (total + EPS)).clamp(max=1.0)
        coefs = {n: c for n in params}
    sums = {n: torch.einsum("b,b...->...", coefs[n], g) for n, g in grads.items()}
    return sums, sq, {n: float((coefs[n] * sq[n].sqrt()).sum()) for n in params}


def trainable_names(model: nn.Module) -> List[str]:
    seen, names = set(), []
    for n, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            names.append(n)
    return names


def fastdp_clipped_sum(model, inputs, weights, max_grad_norm, reduction="mean", micro_batches=1,
                       **kwargs) -> Dict[str, torch.Tensor]:
    """Run one noiseless fastdp step (divisor 1, lr 0) and return {name: p.grad}."""
    opt = fastdp.DPOptimizer(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
        module=model, noise_multiplier=0.0, max_grad_norm=max_grad_norm,
        expected_batch_size=1, loss_reduction=reduction, **kwargs,
    )
    try:
        opt.zero_grad()
        batch = inputs[0].shape[0]
        bounds = torch.linspace(0, batch, micro_batches + 1).round().long().tolist()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi <= lo:
                continue
            losses = sample_loss(model(*[x[lo:hi] for x in inputs]), weights[lo:hi])
            (losses.mean() if reduction == "mean" else losses.sum()).backward()
        opt.step()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    finally:
        opt.detach()


def max_rel_error(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor],
                  scale: Dict[str, float] = None) -> float:
    """Largest ``|got - want| / |want|`` over parameters, or relative to ``scale`` (e.g. the sum
    of the per-sample shares' norms, which rounding errors scale with where shares cancel)."""
    worst = 0.0
    for n, w in want.items():
        err = (got[n] - w).norm() / max(float(w.norm()) if scale is None else scale[n], 1e-30)
        worst = max(worst, float(err))
    return worst


def check_exact(model: nn.Module, inputs, out_shape_fn: Callable = None, tol=1e-9, reduction="mean",
                mode="flat", micro_batches=1, seed=0, **kwargs):
    """Assert fastdp's clipped sum equals the per-example reference (float64)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out = model(*inputs)
    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.device)
    params = trainable_names(model)
    _, sq, _ = clipped_sum_reference(model, inputs, weights, 1.0, params)
    total = torch.stack(list(sq.values())).sum(0).sqrt()
    clip = float(total.median()) if total.numel() else 1.0  # some samples clipped, some not
    clip = clip if clip > 0 else 1.0
    if mode == "per_layer":
        clip = [clip / 2 ** 0.5] * len(params)
    want, _, shares = clipped_sum_reference(model, inputs, weights, clip, params, mode=mode)
    got = fastdp_clipped_sum(model, inputs, weights, clip, reduction=reduction,
                             micro_batches=micro_batches, clipping=mode, **kwargs)
    err = max_rel_error(got, want, shares)  # relative to the shares: they cancel in tiny layers
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"
    return err


def cancelling_linear_inputs(seq=16, d=64, p=64, residual=1e-3, seed=0):
    """One float32 sample whose per-position gradients nearly cancel: the same input at every
    position and output gradients summing to a vector of norm ``residual``, so the ghost sum
    of (a_s . a_t)(g_s . g_t), terms of size ~1, is ~residual^2 (review: a sample built so
    got a float32-Gram norm of 0 or below and escaped clipping)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(d, generator=gen, dtype=torch.float32)
    a = (a / a.norm()).expand(1, seq, d).contiguous()
    u = torch.randn(seq - 1, p, generator=gen, dtype=torch.float32)
    delta = torch.randn(p, generator=gen, dtype=torch.float32)
    g = torch.cat([u, (delta / delta.norm() * residual - u.sum(0))[None]])[None]
    return a, g
