"""pytest-benchmark microbenchmarks of the CPU kernels, each beside the PyTorch composite for
the same math and the naive per-example loop. Not part of the test suite:

    .venv/bin/python -m pytest bench/test_kernel_benchmarks.py --benchmark-only \
        --benchmark-group-by=group --benchmark-columns=min,median,rounds

Within a group, pytest-benchmark prints each row's time relative to the fastest in
parentheses: those ratios are the result (absolute times move with the machine's load).
"""
import pytest
import torch

from fastdp import ops
from kernels_table import conv_case, conv_routes, group_norm_case, group_norm_routes  # bench/ is on sys.path

native = pytest.importorskip("fastdp._native_ops", reason="native extension not built")

# 8 M as 8 tensors: a tensor of 2^23 floats is 32 MiB, where each of the composite's temporaries is
# a fresh mmap (glibc's threshold stops there) and the ratio times page faults (benchmark audit)
NOISE_SIZES = {"1M": [1 << 20], "8M": [1 << 20] * 8, "257 tensors": [4096] * 256 + [1 << 20]}
LINEAR = {"B32 T256 d256 p256": (32, 256, 256, 256), "B64 T64 d512 p512": (64, 64, 512, 512)}
EMBEDDING = {"B64 T128 D256 V1000": (64, 128, 256, 1000)}
# (batch, C_in, C_out, image size, kernel, stride, padding): layers of the CIFAR and MNIST CNNs
CONV = {"CIFAR conv1 B128 3-32 32px k3": (128, 3, 32, 32, 3, 1, 1),
        "CIFAR conv3 B128 64-64 8px k3": (128, 64, 64, 8, 3, 1, 1),
        "MNIST conv1 B256 1-16 28px k8 s2": (256, 1, 16, 28, 8, 2, 2),
        "MNIST conv2 B64 16-32 12px k4 s2": (64, 16, 32, 12, 4, 2, 0)}
# per-sample tensors (B, K) whose per-sample squared norms the rules take
SAMPLE_NORMS = {"B256 K784": (256, 784), "B64 K8192": (64, 8192), "B1 K16M": (1, 1 << 24)}
GROUP_NORM = {"CIFAR gn1 B128 C32 32px G8": (128, 32, 32, 8), "CIFAR gn3 B128 C64 8px G8": (128, 64, 8, 8)}


def _noise_loop(sums, std, divisor):
    """One draw and one add per parameter, as a plain training loop would do it."""
    return [(s + torch.randn_like(s) * std) / divisor for s in sums]


@pytest.mark.parametrize("impl", ["loop", "composite", "native", "native in place"])
@pytest.mark.parametrize("size", list(NOISE_SIZES))
def test_noise(benchmark, size, impl):
    benchmark.group = f"noise {size}"
    sums = [torch.randn(n) for n in NOISE_SIZES[size]]
    run = {
        "loop": lambda: _noise_loop(sums, 1.3, 7.0),
        "composite": lambda: ops.noisy_average_ref(sums, 1.3, 7.0, 11),
        "native": lambda: native.noisy_average(sums, 1.3, 7.0, 11),
        "native in place": lambda: native.noisy_average(sums, 1.3, 7.0, 11, inplace=True),
    }[impl]
    benchmark(run)


def _norms_loop(a, g):
    """Per-example loop: instantiate each sample's (p, d) gradient and take its norm."""
    return torch.stack([(g[i].t() @ a[i]).square().sum().double() for i in range(a.shape[0])])


@pytest.mark.parametrize("impl", ["loop", "bmm ghost", "bmm direct", "native ghost", "native direct"])
@pytest.mark.parametrize("shape", list(LINEAR))
def test_linear_norms(benchmark, shape, impl):
    benchmark.group = f"linear norms {shape}"
    b, t, d, p = LINEAR[shape]
    a, g = torch.randn(b, t, d), torch.randn(b, t, p)
    fn = {"loop": _norms_loop, "bmm ghost": ops.linear_sq_norms_ghost_ref,
          "bmm direct": ops.linear_sq_norms_direct_ref, "native ghost": native.linear_sq_norms_ghost_kernel,
          "native direct": native.linear_sq_norms_direct}[impl]
    benchmark(fn, a, g)


def _embedding_loop(ids, g):
    """Per-example loop: scatter each sample's rows into a dense (V, D) gradient."""
    vocab = int(ids.max()) + 1
    out = []
    for i in range(ids.shape[0]):
        dense = g.new_zeros(vocab, g.shape[-1]).index_add_(0, ids[i], g[i])
        dense[0] = 0  # padding_idx 0
        out.append(dense.square().sum().double())
    return torch.stack(out)


@pytest.mark.parametrize("impl", ["loop", "reference", "native"])
@pytest.mark.parametrize("shape", list(EMBEDDING))
def test_embedding_norms(benchmark, shape, impl):
    benchmark.group = f"embedding norms {shape}"
    b, t, dim, vocab = EMBEDDING[shape]
    ids, g = torch.randint(0, vocab, (b, t)), torch.randn(b, t, dim)
    fn = {"loop": _embedding_loop, "reference": lambda i, x: ops.embedding_sq_norms_ref(i, x, 0),
          "native": lambda i, x: native.embedding_sq_norms(i, x, 0)}[impl]
    benchmark(fn, ids, g)


def _conv_case(shape):
    return conv_case(*CONV[shape])


def _conv_loop(x, g, spec, weight_shape):
    """Per-example loop: each sample's weight gradient from aten's convolution backward."""
    weight = torch.empty(weight_shape)
    return torch.stack([torch.ops.aten.convolution_backward(
        g[i:i + 1], x[i:i + 1], weight, None, spec.stride, spec.padding, spec.dilation, False, [0, 0], 1,
        [False, True, False])[1].square().sum().double() for i in range(x.shape[0])])


def _conv_routes(x, g, spec, weight_shape):
    return {"loop": lambda: _conv_loop(x, g, spec, weight_shape),
            **conv_routes(x, g, spec, weight_shape, native.conv_sq_norms)}


@pytest.mark.parametrize("impl", ["loop", "composed ghost (unfold)", "composed direct (grouped conv)", "native ghost",
                                  "native direct", "native direct, kept gradients", "native direct, input gradient",
                                  "weight gradient", "input gradient"])
@pytest.mark.parametrize("shape", list(CONV))
def test_conv_norms(benchmark, shape, impl):
    benchmark.group = f"conv norms {shape}"
    benchmark(_conv_routes(*_conv_case(shape))[impl])


@pytest.mark.parametrize("impl", ["loop", "reference", "native"])
@pytest.mark.parametrize("shape", list(SAMPLE_NORMS))
def test_sample_sq_norms(benchmark, shape, impl):
    benchmark.group = f"per-sample squared norms {shape}"
    x = torch.randn(*SAMPLE_NORMS[shape])
    fn = {"loop": lambda: torch.stack([row.square().sum().double() for row in x]),
          "reference": lambda: ops.sample_sq_norms_ref(x), "native": lambda: native.sample_sq_norms(x)}[impl]
    benchmark(fn)


def _group_norm_loop(g, x, mean, rstd, weight, groups):
    """Per-example loop: autograd through each sample's group norm (input and parameter gradients)."""
    out = []
    for i in range(x.shape[0]):
        xi, wi = x[i:i + 1].clone().requires_grad_(), weight.clone().requires_grad_()
        bi = torch.zeros_like(weight, requires_grad=True)
        out_i = torch.nn.functional.group_norm(xi, groups, wi, bi, 1e-5)
        out.append(torch.autograd.grad(out_i, (xi, wi, bi), g[i:i + 1]))
    return [torch.cat([o[0] for o in out]), *(torch.stack([o[k] for o in out]) for k in (1, 2))]


def _group_norm_routes(case):
    return {"loop": lambda: _group_norm_loop(*case), **group_norm_routes(case, native.group_norm_backward)}


@pytest.mark.parametrize("impl", ["loop", "reference", "native", "aten backward"])
@pytest.mark.parametrize("shape", list(GROUP_NORM))
def test_group_norm_backward(benchmark, shape, impl):
    benchmark.group = f"group norm backward {shape}"
    benchmark(_group_norm_routes(group_norm_case(*GROUP_NORM[shape]))[impl])


def test_references_agree():
    """The rows above compute the same numbers (so the ratios compare like with like)."""
    a, g = torch.randn(4, 70, 33), torch.randn(4, 70, 20)
    want = _norms_loop(a.double(), g.double())
    for fn in (ops.linear_sq_norms_ghost_ref, ops.linear_sq_norms_direct_ref,
               native.linear_sq_norms_ghost_kernel, native.linear_sq_norms_direct):
        torch.testing.assert_close(fn(a, g), want, rtol=1e-5, atol=0)
    ids, e = torch.randint(0, 9, (5, 30)), torch.randn(5, 30, 7, dtype=torch.float64)
    torch.testing.assert_close(_embedding_loop(ids, e), ops.embedding_sq_norms_ref(ids, e, 0))
    torch.testing.assert_close(native.embedding_sq_norms(ids, e, 0), ops.embedding_sq_norms_ref(ids, e, 0))
    for shape in CONV:
        x, g, spec, weight_shape = _conv_case(shape)
        x, g = x[:3], g[:3]
        routes = _conv_routes(x, g, spec, weight_shape)
        want = routes.pop("loop")()
        routes.pop("weight gradient")
        torch.testing.assert_close(routes.pop("native direct, input gradient")(), routes.pop("input gradient")(),
                                   rtol=1e-4, atol=1e-4)
        for route in routes.values():
            torch.testing.assert_close(route(), want, rtol=1e-5, atol=0)
    for shape in GROUP_NORM:
        g, x, mean, rstd, weight, groups = group_norm_case(*GROUP_NORM[shape])
        routes = _group_norm_routes((g[:3], x[:3], mean[:3], rstd[:3], weight, groups))
        want = routes.pop("loop")()
        routes.pop("aten backward")
        for route in routes.values():
            for got, exact in zip(route(), want):
                torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
