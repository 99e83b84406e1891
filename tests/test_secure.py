"""Secure mode: OS entropy for every noise draw and every batch, Gaussian noise of the right
law, no user seed; the default mode stays reproducible."""
import math
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fastdp
from fastdp.data import PoissonBatchSampler
from fastdp.secure import secure_noisy_average

C, SIGMA, B = 0.5, 1.5, 4.0


def optimizer(model, **kwargs):
    return fastdp.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), module=model, noise_multiplier=SIGMA,
                              max_grad_norm=C, expected_batch_size=B, **kwargs)


def noise_of(opt, model):
    opt.step()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_seed_with_secure_mode_is_an_error():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="seed"):
        optimizer(model, seed=1, secure_mode=True)
    loader = DataLoader(TensorDataset(torch.zeros(8, 2), torch.zeros(8, dtype=torch.long)), batch_size=2)
    with pytest.raises(ValueError, match="seed"):
        fastdp.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
                            max_grad_norm=1.0, noise_multiplier=1.0, seed=1, secure_mode=True)


def test_secure_noise_has_the_right_gaussian_law():
    model = nn.Linear(50, 40)
    opt = optimizer(model, secure_mode=True)
    z = torch.cat([noise_of(opt, model) for _ in range(40)]).double() / (SIGMA * C / B)
    n = z.numel()
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2 / n)
    # Gaussian tails: P(|z| > 2) = 4.55%; fourth moment 3
    tail = (z.abs() > 2).double().mean().item()
    assert abs(tail - 0.0455) < 5 * math.sqrt(0.0455 * 0.9545 / n)
    assert abs((z ** 4).mean().item() - 3) < 5 * math.sqrt(96 / n)


def test_secure_noise_is_never_replayed():
    model_a, model_b = nn.Linear(6, 5), nn.Linear(6, 5)
    opt_a, opt_b = optimizer(model_a, secure_mode=True), optimizer(model_b, secure_mode=True)
    opt_b.load_state_dict(opt_a.state_dict())  # same seed-generator state: irrelevant in secure mode
    a = noise_of(opt_a, model_a)
    assert not torch.equal(a, noise_of(opt_b, model_b))
    assert not torch.equal(a, noise_of(opt_a, model_a))


def test_default_mode_is_reproducible():
    model_a, model_b = nn.Linear(6, 5), nn.Linear(6, 5)
    opt_a, opt_b = optimizer(model_a, seed=5), optimizer(model_b, seed=5)
    assert torch.equal(noise_of(opt_a, model_a), noise_of(opt_b, model_b))


def test_every_step_and_batch_draws_os_entropy(monkeypatch):
    calls = []
    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: calls.append(n) or real(n))
    model = nn.Linear(3, 2)
    opt = optimizer(model, secure_mode=True)
    for _ in range(3):
        calls.clear()
        opt.step()
        assert sum(calls) >= 16 * 8  # two normals of two 64-bit words for each of the 8 coordinates
    sampler = PoissonBatchSampler(100, 0.1, steps=4, secure_mode=True)
    calls.clear()
    list(sampler)
    assert len(calls) == 4 and all(n >= 32 for n in calls)  # 256 bits per batch


def test_result_is_rounded_once_to_the_parameter_dtype():
    s = torch.randn(1000)
    out, = secure_noisy_average([s], 0.0, 3.0)
    assert out.dtype == torch.float32 and torch.equal(out, (s.double() / 3.0).float())
    half, = secure_noisy_average([s.bfloat16()], 1.0, 1.0)
    assert half.dtype == torch.bfloat16


def test_make_private_secure_mode_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    loader = DataLoader(TensorDataset(torch.randn(20, 4), torch.randint(0, 3, (20,))), batch_size=5)
    model, opt, loader = fastdp.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             data_loader=loader, max_grad_norm=1.0, noise_multiplier=1.0,
                                             secure_mode=True)
    assert opt.secure_mode and loader.batch_sampler.secure_mode and loader.state_dict(include_secrets=True)["seed"] is None
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.accountant.history == [(1.0, 0.25, 4)]


def test_secure_noise_comes_from_every_bit_of_os_entropy(monkeypatch):
    """No seeded generator in between: torch's CPU generator keeps 32 bits of a seed, which left
    2^32 possible noise vectors per step (searchable against one released gradient)."""
    def stream(flip_high_bits):
        state = {"n": 0}

        def urandom(n):
            out = bytearray((state["n"] + i) * 37 % 251 for i in range(n))
            if flip_high_bits:  # change only bytes 4..7 of every 8-byte word
                for i in range(n):
                    if (state["n"] + i) % 8 >= 4:
                        out[i] ^= 0x5A
            state["n"] += n
            return bytes(out)
        return urandom

    draws = []
    for flip in (False, False, True):
        monkeypatch.setattr(os, "urandom", stream(flip))
        draws.append(secure_noisy_average([torch.zeros(64, dtype=torch.float64)], 1.0, 1.0)[0])
    assert torch.equal(draws[0], draws[1])  # a function of the OS bytes alone
    assert not torch.equal(draws[0], draws[2])


def test_os_normals_are_standard_normal():
    from scipy import stats

    from fastdp.secure import os_normals
    z = os_normals(300_001)
    assert z.dtype == torch.float64 and z.shape == (300_001,)
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-4
    assert abs(z.mean().item()) < 5 / math.sqrt(z.numel())
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2 / z.numel())
    assert z.abs().max().item() <= math.sqrt(-2 * math.log(2.0**-53))  # 53-bit uniforms: |z| <= 8.57
    assert os_normals(0).shape == (0,) and os_normals(1).shape == (1,)
