"""Native (C++) fused convolution norms against per-sample weight gradients in float64.

The kernel unfolds one sample's patches at a time (zero padding, stride, dilation, groups)
and runs the linear ghost or direct tiles on them; the reference convolves each sample on
its own. Error bound as for the linear kernels: relative to the norms of the absolute
values' gradients, which bound every rounded partial sum. The input gradient the kernel
can write beside the norms is checked against aten's in float64, entry by entry, within
the a-priori bound of a rounded sum of n products (n u times the sum of their magnitudes).
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdp import ops
from fastdp.layers.conv import ConvSpec

native = pytest.importorskip("fastdp._native_ops", reason="native extension not built")
TOL = {torch.float32: 2e-6, torch.float64: 1e-12}


def per_sample_grads(x, g, spec):
    """Sample by sample: aten's weight gradient of a batch of one, in float64."""
    weight = torch.empty(g.shape[1], x.shape[1] // spec.groups, *spec.kernel, dtype=torch.float64)
    return [torch.ops.aten.convolution_backward(
        g[i:i + 1].double(), x[i:i + 1].double(), weight, None, spec.stride, spec.padding, spec.dilation,
        False, [0] * len(spec.stride), spec.groups, [False, True, False])[1] for i in range(x.shape[0])]


def per_sample_sq_norms(x, g, spec):
    grads = per_sample_grads(x, g, spec)
    return torch.stack([grad.square().sum() for grad in grads]) if grads else torch.zeros(0, dtype=torch.float64)


def _case(dim, batch, groups, cin, cout, kernel, stride, padding, dilation, size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    spec = ConvSpec([stride] * dim, [padding] * dim, [dilation] * dim, groups, [kernel] * dim)
    x = torch.randn(batch, cin * groups, *[size] * dim, generator=gen, dtype=torch.float64).to(dtype)
    out_size = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    g = torch.randn(batch, cout * groups, *[out_size] * dim, generator=gen, dtype=torch.float64).to(dtype)
    return x, g, spec


def input_grad(x, g, weight, spec):
    """aten's input gradient in float64."""
    return torch.ops.aten.convolution_backward(
        g.double(), x.double(), weight.double(), None, spec.stride, spec.padding, spec.dilation,
        False, [0] * len(spec.stride), spec.groups, [True, False, False])[0]


def _check(result, x, g, spec, weight=None):
    out, grads, bias, grad_input = result
    exact = per_sample_sq_norms(x, g, spec)
    scale = per_sample_sq_norms(x.double().abs(), g.double().abs(), spec)
    assert out.dtype == torch.float64 and out.shape == (x.shape[0],)
    err = ((out - exact).abs() / scale.clamp_min(1e-300)).max().item() if x.shape[0] else 0.0
    assert err < TOL[x.dtype if x.dtype in TOL else torch.float32], err
    if grads is not None:  # each entry is one sum over positions: bounded by the |x| |g| sums
        want = torch.stack(per_sample_grads(x, g, spec))
        bound = torch.stack(per_sample_grads(x.double().abs(), g.double().abs(), spec))
        assert grads.shape == want.shape
        assert ((grads.double() - want).abs() <= TOL[grads.dtype] * bound + 1e-300).all()
    if bias is not None:  # each entry one float64 sum over positions, then rounded once
        want, bound = g.double().flatten(2).sum(2), g.double().abs().flatten(2).sum(2)
        assert bias.shape == want.shape and bias.dtype == out_dtype(x)
        assert ((bias.double() - want).abs() <= TOL[bias.dtype] * bound + 1e-300).all()
    assert (grad_input is not None) == (weight is not None)
    if grad_input is not None:
        want, bound = input_grad(x, g, weight, spec), input_grad(x.abs(), g.abs(), weight.abs(), spec)
        terms = g.shape[1] // spec.groups * weight[0, 0].numel()  # products summed per entry
        assert grad_input.shape == x.shape and grad_input.dtype == out_dtype(x)
        assert ((grad_input.double() - want).abs() <= terms * torch.finfo(grad_input.dtype).eps * bound + 1e-300).all()


def out_dtype(x):
    return x.dtype if x.dtype in TOL else torch.float32


@settings(max_examples=60, deadline=None)
@given(dim=st.sampled_from([1, 2]), batch=st.sampled_from([1, 2, 5]), groups=st.sampled_from([1, 2, 3]),
       cin=st.integers(1, 5), cout=st.integers(1, 20), kernel=st.integers(1, 5), stride=st.integers(1, 3),
       padding=st.integers(0, 3), dilation=st.integers(1, 2), extra=st.integers(0, 12),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**31 - 1))
def test_matches_per_sample_gradients(dim, batch, groups, cin, cout, kernel, stride, padding, dilation, extra,
                                      dtype, seed):
    size = max(1, dilation * (kernel - 1) + 1 - 2 * padding) + extra  # at least one output position
    x, g, spec = _case(dim, batch, groups, cin, cout, kernel, stride, padding, dilation, size, dtype, seed)
    weight = torch.randn(cout * groups, cin, *spec.kernel, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float64).to(dtype)
    for ghost, keep, bias, dx in ((True, False, True, True), (False, False, False, False), (False, True, True, True),
                                  (True, False, False, False), (False, False, True, True)):
        w = weight if dx else None
        result = native.conv_sq_norms(x, g, spec, ghost, keep_grads=keep, bias_grads=bias, input_weight=w)
        assert (result[1] is not None) == keep and (result[2] is not None) == bias
        _check(result, x, g, spec, w)


@pytest.mark.parametrize("ghost", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_several_tiles_each_way(ghost, dtype):
    """T = 20 x 20 = 400 positions (several 64-row Gram tiles), d = 7 * 9 = 63 and p = 70
    ragged against the 64-wide tiles and the 16-lane vectors."""
    x, g, spec = _case(2, 3, 1, 7, 70, 3, 1, 1, 1, 20, dtype, 0)
    weight = torch.randn(70, 7, 3, 3, dtype=dtype)
    _check(native.conv_sq_norms(x, g, spec, ghost, keep_grads=True, input_weight=weight), x, g, spec, weight)


@pytest.mark.parametrize("shape", [(70, 7, 3, 1), (70, 7, 3), (1,), (35, 7, 3, 3)])
def test_an_input_weight_of_another_shape_is_refused(shape):
    """The kernel reads C_out x C_in / groups x kernel floats from the weight's address whatever the
    tensor holds: a smaller weight was read past its end, a garbage input gradient (kernel review)."""
    x, g, spec = _case(2, 2, 1, 7, 70, 3, 1, 1, 1, 6, torch.float32, 0)
    with pytest.raises(ValueError, match="is not the convolution's"):
        native.conv_sq_norms(x, g, spec, False, input_weight=torch.randn(shape))


def test_ghost_route_survives_cancellation():
    """Equal patches at every position (a constant image) and output gradients that sum to
    1e-3 of their size: the ghost terms cancel to ~1e-6 of theirs. Float64 Grams keep the norm
    within float64's a-priori bound; float32 ones were off by ~100 % (review)."""
    gen = torch.Generator().manual_seed(0)
    spec = ConvSpec([1, 1], [0, 0], [1, 1], 1, [3, 3])
    x = torch.randn(1, 4, 1, 1, generator=gen).expand(1, 4, 10, 10).contiguous()
    u = torch.randn(1, 6, 64, generator=gen)
    residual = torch.randn(1, 6, generator=gen) * 1e-3
    u[..., -1] += residual - u.sum(-1)
    g = u.view(1, 6, 8, 8)
    exact = per_sample_sq_norms(x, g, spec)
    out = native.conv_sq_norms(x, g, spec, True)[0]
    assert ((out - exact).abs() / exact).item() < 1e-6


def test_other_dtypes_and_layouts():
    """bfloat16 runs through float32; a channels-last input and a grad tensor are copied as needed."""
    x, g, spec = _case(2, 2, 1, 3, 4, 3, 2, 1, 1, 9, torch.float32, 1)
    weight = torch.randn(4, 3, 3, 3).requires_grad_()
    _check(native.conv_sq_norms(x.to(memory_format=torch.channels_last).requires_grad_(), g, spec, True,
                                input_weight=weight.transpose(2, 3).contiguous().transpose(2, 3)), x, g, spec, weight)
    x16, g16 = x.bfloat16(), g.bfloat16()
    _check(native.conv_sq_norms(x16, g16, spec, False, keep_grads=True, input_weight=weight.bfloat16()),
           x16.float(), g16.float(), spec, weight.bfloat16().float())


def test_declines_what_it_does_not_take(monkeypatch):
    """3-D convolutions and samples whose patches exceed the scratch bound go to the composed routes."""
    x, g, spec = _case(3, 2, 1, 2, 3, 2, 1, 0, 1, 4, torch.float32, 2)
    assert native.conv_sq_norms(x, g, spec, True) is None
    x, g, spec = _case(2, 2, 1, 2, 3, 3, 1, 1, 1, 8, torch.float32, 3)
    monkeypatch.setattr(native, "CONV_MAX_UNFOLDED", 2 * 9 * 64 - 1)
    assert native.conv_sq_norms(x, g, spec, True) is None


def test_non_finite_input_that_no_output_reads_leaves_the_norms_finite():
    """Stride 2 over 6 columns with k = 3: column 5 is never read, yet the kernel's wide layout
    multiplied it by zero output gradients, so a NaN there made the norm NaN and the engine
    raise for a finite gradient (review). The kernel now says so and the composed routes run."""
    torch.manual_seed(0)
    layer = torch.nn.Conv2d(2, 3, 3, stride=2).double()
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    x[0, :, :, 5] = float("nan")
    out = layer(x)
    assert torch.isfinite(out).all()
    g = torch.randn_like(out)
    spec = ConvSpec([2, 2], [0, 0], [1, 1], 1, [3, 3])
    for ghost in (True, False):
        assert native.conv_sq_norms(x, g, spec, ghost) is None
    clean = x.clone()
    clean[0, :, :, 5] = 0.0  # the same gradients: column 5 does not enter them
    for ghost in (True, False):
        torch.testing.assert_close(native.conv_sq_norms(clean, g, spec, ghost)[0], per_sample_sq_norms(clean, g, spec))
    import fastdp
    model = torch.nn.Sequential(layer)
    opt = fastdp.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), module=model, noise_multiplier=0.0,
                             max_grad_norm=1.0, expected_batch_size=2, loss_reduction="sum")
    (model(x) * g).sum().backward()
    opt.step()  # raised NonFiniteGradientError for sample 0 on the native backend
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("backend", ["native", None, "reference"])
def test_dispatch(use_backend, backend):
    """The CPU default and FASTDP_BACKEND=native take the kernel; the reference composes (None)."""
    use_backend(backend)
    x, g, spec = _case(2, 2, 1, 2, 3, 3, 1, 1, 1, 6, torch.float64, 4)
    out = ops.conv_sq_norms(x, g, spec, True)
    if backend == "reference":
        assert out is None
    else:
        _check(out, x, g, spec)
