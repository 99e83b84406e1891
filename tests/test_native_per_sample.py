"""Native (C++) per-sample steps against their PyTorch references: squared norms of a
(B, ...) tensor, totals over parameters with their finiteness, clipping factors; and the
weighted sum that reads kernel-written (permuted) per-sample gradients in place."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdp import ops
from fastdp.layers.base import weighted_sum

native = pytest.importorskip("fastdp._native_ops", reason="native extension not built")


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(0, 9), shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       transposed=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_sample_sq_norms_match_float64_sums(batch, shape, dtype, transposed, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *shape, generator=gen, dtype=torch.float64).to(dtype)
    if transposed:  # a non-contiguous layout is copied first
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    out = native.sample_sq_norms(x)
    exact = x.double().flatten(1).square().sum(1)
    assert out.dtype == torch.float64 and out.shape == (batch,)
    # each product is formed and summed in float64: float32 inputs lose only the last bits
    torch.testing.assert_close(out, exact, rtol=1e-12, atol=0)


def test_sample_sq_norms_long_rows_split_into_chunks():
    """Rows longer than one work item (64K elements) are summed from partial sums in a fixed
    order: same result with one thread and with two."""
    x = torch.randn(3, 200_003, dtype=torch.float64)
    exact = x.square().sum(1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.sample_sq_norms(x)
        torch.set_num_threads(2)
        two = native.sample_sq_norms(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, exact, rtol=1e-13, atol=0)


def test_sample_sq_norms_is_the_cpu_default(use_backend):
    use_backend(None)
    assert ops.implementation("sample_sq_norms", torch.device("cpu")) == ("native", native.sample_sq_norms)
    use_backend("reference")
    assert ops.implementation("sample_sq_norms", torch.device("cpu"))[0] == "reference"


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 6), shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_weighted_sum_of_permuted_layouts(batch, shape, data):
    """Per-sample tensors whose sample dims lie in memory in any order give the same sum as
    their contiguous copy, and the result is contiguous."""
    order = data.draw(st.permutations(range(1, len(shape) + 1)))
    stored = torch.randn(batch, *[shape[k - 1] for k in order], dtype=torch.float64)
    per_sample = stored.permute(0, *[order.index(k) + 1 for k in range(1, len(shape) + 1)])
    assert per_sample.shape == (batch, *shape)
    coef = torch.rand(batch, dtype=torch.float64)
    out = weighted_sum(coef, per_sample)
    want = (coef.view(-1, *[1] * len(shape)) * per_sample).sum(0)
    assert out.is_contiguous() and out.shape == tuple(shape)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 300), parts=st.integers(1, 7), bad=st.sampled_from([None, "nan", "inf"]),
       seed=st.integers(0, 2**31 - 1))
def test_totals_and_their_finiteness(batch, parts, bad, seed):
    gen = torch.Generator().manual_seed(seed)
    sq = [torch.rand(batch, generator=gen, dtype=torch.float64) * 10.0 ** (6 * k - 12) for k in range(parts)]
    if bad is not None:
        sq[parts // 2][batch // 2] = float(bad)
    total, finite = native.total_sq_norms(sq)
    want, _ = ops.total_sq_norms_ref(sq)
    assert finite == (bad is None)
    torch.testing.assert_close(total, want, rtol=1e-15, atol=0, equal_nan=True)


def test_total_overflow_is_not_a_nonfinite_sample():
    """Each sum finite although their batch total overflows: finite (the reference's single
    reduction says not, and the engine then looks at every sample)."""
    total, finite = native.total_sq_norms([torch.full((4,), 1e308, dtype=torch.float64)])
    assert finite and math.isfinite(total.max().item())


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(0, 50), scale=st.sampled_from([1.0, 7.0, 256.0]), clamp=st.booleans(),
       offset=st.sampled_from([1e-6, 0.01]), seed=st.integers(0, 2**31 - 1))
def test_clip_factors(batch, scale, clamp, offset, seed):
    gen = torch.Generator().manual_seed(seed)
    total = torch.rand(batch, generator=gen, dtype=torch.float64) * 4.0
    if batch > 3:  # a ghost norm of a ~0 gradient can come out a rounding below 0
        total[0], total[1], total[2], total[3] = 0.0, float("inf"), float("nan"), -1e-18
    out = native.clip_factors(total, 1.5, scale, offset, clamp)
    want = ops.clip_factors_ref(total, 1.5, scale, offset, clamp)
    torch.testing.assert_close(out, want, rtol=1e-14, atol=0, equal_nan=True)
    if batch > 3:  # a zero gradient keeps its coefficient scale (flat) or scale C / offset
        for zero in (0, 3):
            assert out[zero].item() == pytest.approx(scale if clamp else 1.5 * scale / offset, rel=1e-15)
        assert out[1].item() == 0.0 and math.isnan(out[2].item())


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(0, 9), d=st.integers(1, 70), p=st.integers(1, 70),
       dtypes=st.sampled_from([(torch.float32, torch.float32), (torch.float64, torch.float64),
                               (torch.float32, torch.float64)]), seed=st.integers(0, 2**31 - 1))
def test_outer_sq_norms_of_one_row_per_sample(batch, d, p, dtypes, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, d, generator=gen, dtype=torch.float64).to(dtypes[0])
    g = torch.randn(batch, p, generator=gen, dtype=torch.float64).to(dtypes[1])
    weight, bias = native.outer_sq_norms(a, g)
    # exact per-sample gradients g_i a_i^T, then their squared norms
    want_weight = torch.einsum("bp,bd->bpd", g.double(), a.double()).flatten(1).square().sum(1)
    want_bias = g.double().square().sum(1)
    assert weight.dtype == bias.dtype == torch.float64 and weight.shape == bias.shape == (batch,)
    torch.testing.assert_close(weight, want_weight, rtol=1e-12, atol=0)
    torch.testing.assert_close(bias, want_bias, rtol=1e-12, atol=0)
