"""Kernels against their references: native (C++) directly, Triton under TRITON_INTERPRET=1.

Shapes and dtypes are drawn by hypothesis and kept small so the interpreter stays fast.
The noise tests check the Philox stream (known-answer vectors, the three implementations
agree), the normal transform against float64 math, and the statistics of millions of draws.
"""
import importlib
import math
import os
import warnings

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fastdp import ops
from reference import cancelling_linear_inputs

native = pytest.importorskip("fastdp._native_ops", reason="native extension not built")


CUDA = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if CUDA else "cpu"  # Triton compiled for the GPU, else interpreted on CPU


def _interpreted(name: str):
    """Import (or re-import) a Triton kernel module with TRITON_INTERPRET=1, for CPU tensors."""
    pytest.importorskip("triton")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.reload(importlib.import_module("kernels.reductions"))  # shared jit helpers first
        return importlib.reload(importlib.import_module(name))
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


@pytest.fixture(scope="module")
def tri():
    """The Triton kernel modules: compiled where a GPU is present, else under the interpreter."""
    names = ("noise", "linear_norms", "embedding_norms")
    if CUDA:
        pytest.importorskip("triton")
        return {name: importlib.import_module(f"kernels.{name}") for name in names}
    return {name: _interpreted(f"kernels.{name}") for name in names}


def on_triton_device(*tensors):
    return [t.to(TRITON_DEVICE) for t in tensors]


def cuda_native():
    """The CUDA C++ noise kernel (fastdp._cuda_ops) where a GPU and the built library exist."""
    if not CUDA:
        return None
    try:
        return importlib.import_module("fastdp._cuda_ops").noisy_average
    except ImportError:  # the library is built by `make cuda-lib`, not by pip
        return None


noise_ref = importlib.import_module("kernels.noise") if importlib.util.find_spec("triton") else None
FAST = settings(max_examples=12, deadline=None)
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.bfloat16])


def rel_err(x, ref):
    return ((x - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()


# --------------------------------------------------------------------------- noise stream


@pytest.mark.skipif(noise_ref is None, reason="triton not installed")
def test_philox_known_answers():
    """Random123's published Philox4x32-10 vectors."""
    one = lambda v: torch.tensor([v], dtype=torch.int64)
    cases = [
        ([0, 0, 0, 0], (0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, (0xFFFFFFFF, 0xFFFFFFFF), [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], (0xA4093822, 0x299F31D0),
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for counter, key, expected in cases:
        out = noise_ref.philox4x32_10_ref([one(c) for c in counter], *key)
        assert [int(w) for w in out] == expected


@pytest.mark.skipif(noise_ref is None, reason="triton not installed")
def test_box_muller_matches_float64_math():
    """The polynomial ln/sin/cos agree with float64 libm on the same (float32) u and angle."""
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (2, 1 << 18), generator=gen, dtype=torch.int64)
    words[0, :4] = torch.tensor([0, 1, 2**32 - 1, 2**31])  # u at both ends
    words[1, :4] = torch.tensor([0, 2**30, 2**31, 3 * 2**30])  # quadrant boundaries
    z0, z1 = noise_ref.box_muller_ref(words[0], words[1])
    # u: 39 bits (31 of the radius word, the angle word's low 8), rounded to float32 by design
    u = (((words[0] >> 1).float() + ((words[1] & 255) + 1).float() / 256) * 2.0**-31).double()
    r = torch.sqrt(-2 * torch.log(u))
    theta = 2 * math.pi * (words[1] & 0xFFFFFF00).double() / 2**32  # the angle word's top 24 bits
    tol = 4e-7 * (1 + r)
    assert ((z0.double() - r * torch.cos(theta)).abs() <= tol).all()
    assert ((z1.double() - r * torch.sin(theta)).abs() <= tol).all()


@pytest.mark.skipif(noise_ref is None, reason="triton not installed")
@FAST
@given(
    sizes=st.lists(st.integers(0, 2600), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),  # the kernels' (float64: ops.noisy_average)
    seed=st.integers(0, 2**64 - 1),
    std=st.floats(0.1, 3.0),
    divisor=st.floats(0.5, 300.0),
)
# Seed words equal to 1 are specialised to constants by the Triton compiler unless told not to.
@example(sizes=[5], dtype=torch.float32, seed=2**32 + 1, std=1.0, divisor=1.0)
def test_noise_kernels_match_stream_reference(tri, sizes, dtype, seed, std, divisor):
    sums = [torch.randn(n, dtype=torch.float64).to(dtype) for n in sizes]
    ref = noise_ref.noisy_average_philox_ref(sums, std, divisor, seed)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-6
    on_device = lambda impl: lambda xs, *args: [o.cpu() for o in impl(on_triton_device(*xs), *args)]  # noqa: E731
    impls = [native.noisy_average, on_device(tri["noise"].noisy_average_triton)]
    if cuda_native():
        impls.append(on_device(cuda_native()))
    for impl in impls:
        out = impl(sums, std, divisor, seed)
        for o, r, s in zip(out, ref, sums):
            assert o.dtype == s.dtype and o.shape == s.shape
            torch.testing.assert_close(o.double(), r.double(), rtol=tol, atol=tol * (1 + std) / divisor)


@pytest.mark.parametrize("std", [0.0, 1.5])
def test_noise_inplace_equals_out_of_place(tri, std):
    """``inplace=True`` (what the optimizer uses) gives the same numbers, written into the sums."""
    sums = [torch.randn(3000), torch.randn(7, 5), torch.randn(1)]
    impls = {"reference": ops.noisy_average_ref, "native": native.noisy_average,
             "triton": tri["noise"].noisy_average_triton}
    if cuda_native():
        impls["cuda-c++"] = cuda_native()
    for name, impl in impls.items():
        device = TRITON_DEVICE if name in ("triton", "cuda-c++") else "cpu"
        fresh = [s.to(device) for s in sums]
        want = impl(fresh, std, 3.0, 9)
        assert all(torch.equal(f.cpu(), s) for f, s in zip(fresh, sums)), name  # untouched
        got = impl(fresh, std, 3.0, 9, inplace=True)
        for g, w, f in zip(got, want, fresh):
            assert torch.equal(g, w), name
            assert g.data_ptr() == f.data_ptr(), name  # written in place


@pytest.mark.parametrize("std", [0.0, 1.5])
def test_noise_inplace_leaves_an_expanded_sum_alone(tri, std):
    """An expanded (stride-0) sum cannot be written in place: native divided it in place at std = 0
    and raised (native kernel review); the noise path already worked on a copy."""
    impls = {"reference": ops.noisy_average_ref, "native": native.noisy_average,
             "triton": tri["noise"].noisy_average_triton}
    for name, impl in impls.items():
        device = TRITON_DEVICE if name == "triton" else "cpu"
        s = torch.ones(1, 8, device=device).expand(4, 8)
        (got,) = impl([s], std, 2.0, 1, inplace=True)
        (want,) = impl([s.contiguous()], std, 2.0, 1)
        assert torch.equal(got.cpu(), want.cpu()), name
        assert torch.equal(s.cpu(), torch.ones(4, 8)), name


def test_native_noise_shapes_and_layouts():
    """Non-contiguous and n-d tensors are handled; std=0 is the plain average."""
    s = torch.randn(6, 5).t()
    (out,) = native.noisy_average([s], 1.0, 2.0, 1)
    (ref,) = native.noisy_average([s.contiguous()], 1.0, 2.0, 1)
    assert out.shape == s.shape and torch.equal(out, ref)
    assert torch.equal(native.noisy_average([s], 0.0, 2.0, 1)[0], s / 2)


N_STAT = 1 << 22


@pytest.fixture(scope="module")
def draws():
    """z of four parameters (two under seed 7, one under seed 8) from the native kernel."""
    zeros = [torch.zeros(N_STAT), torch.zeros(N_STAT), torch.zeros(1000, 3)]
    a = native.noisy_average(zeros, 1.0, 1.0, 7)
    b = native.noisy_average(zeros[:1], 1.0, 1.0, 8)
    return a[0].double(), a[1].double(), b[0].double()


def test_noise_is_standard_normal(draws):
    from scipy import stats

    z = draws[0].numpy()
    n = z.size
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.std() - 1) < 5 * math.sqrt(0.5 / n)
    assert stats.kstest(z, "norm").pvalue > 1e-4
    tail = stats.norm.sf(4.0) * 2
    assert abs((np.abs(z) > 4.0).sum() - n * tail) < 6 * math.sqrt(n * tail)
    assert abs(stats.kurtosis(z)) < 5 * math.sqrt(24 / n)


def test_noise_streams_are_uncorrelated(draws):
    z, other_param, other_seed = draws
    bound = 5 / math.sqrt(z.numel())
    corr = lambda x, y: float(torch.corrcoef(torch.stack([x, y]))[0, 1])
    assert abs(corr(z, other_param)) < bound  # parameters of one step
    assert abs(corr(z, other_seed)) < bound  # consecutive seeds (steps)
    assert abs(corr(z[:-1], z[1:])) < bound  # neighbouring elements
    lanes = z[: (z.numel() // 1024) * 1024].view(-1, 4, 256)  # the 4 words of one Philox call
    for i in range(3):
        assert abs(corr(lanes[:, i].reshape(-1), lanes[:, i + 1].reshape(-1))) < 2 * bound
        assert abs(corr(lanes[:, i].reshape(-1) ** 2, lanes[:, i + 1].reshape(-1) ** 2)) < 2 * bound


def test_noise_reproducible_and_scaled():
    s = torch.randn(50_001)
    z = native.noisy_average([torch.zeros_like(s)], 1.0, 1.0, 42)[0]
    again = native.noisy_average([torch.zeros_like(s)], 1.0, 1.0, 42)[0]
    assert torch.equal(z, again)
    out = native.noisy_average([s], 2.5, 8.0, 42)[0]
    torch.testing.assert_close(out, (s + 2.5 * z) / 8.0, rtol=1e-6, atol=1e-6)
    assert not torch.equal(z, native.noisy_average([torch.zeros_like(s)], 1.0, 1.0, 43)[0])


@pytest.mark.parametrize("inplace", [False, True])
def test_native_noise_with_a_divisor_below_float32s_reciprocal_range(inplace):
    """A divisor under 1 / FLT_MAX (2.9e-39) made the kernel's float32 reciprocal Inf: every
    coordinate came out +-Inf or NaN where dividing gives finite values (review)."""
    s = torch.full((1000,), 1e-3)
    z = native.noisy_average([torch.zeros_like(s)], 1.0, 1.0, 7)[0]
    out = native.noisy_average([s.clone()], 1e-3, 1e-39, 7, inplace=inplace)[0]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, (s + 1e-3 * z) / 1e-39, rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_noise_depends_on_all_64_bits_of_the_seed(backend):
    """torch's CPU generator keeps 32 bits of a seed: seeds differing only in their high word gave
    the reference backend the same noise (two steps of a long run collided by chance)."""
    impl = {"reference": ops.noisy_average_ref, "native": native.noisy_average}[backend]
    seed = 0x0123456789ABCDEF
    swapped = (seed >> 32) | ((seed & 0xFFFFFFFF) << 32)  # the same two words, swapped
    draws = [impl([torch.zeros(1000)], 1.0, 1.0, s)[0] for s in (seed, seed ^ (1 << 40), seed ^ 1, swapped)]
    assert all(not torch.equal(draws[0], other) for other in draws[1:])
    z = ops.noisy_average_ref([torch.zeros(200_000, dtype=torch.float64)], 1.0, 1.0, seed)[0]
    assert abs(z.mean().item()) < 5 / 200_000**0.5 and abs(z.var().item() - 1) < 5 * (2 / 200_000) ** 0.5


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_noise_of_seeds_sharing_a_32_bit_word_is_uncorrelated(backend):
    """The reference drew z = (3 z_low + 4 z_high) / 5 from two generators seeded with the seed's
    words: two steps whose seeds shared a word (about one pair in 54k steps of a run) got noise
    correlated by 0.36 to 0.64 (review)."""
    impl = {"reference": ops.noisy_average_ref, "native": native.noisy_average}[backend]
    seed, mask, xor = 0x0123456789ABCDEF, 0xFFFFFFFF, 0x9E3779B9  # xor: how the reference keys its second generator
    low, high = seed & mask, seed >> 32
    others = [(0x55555555 << 32) | low,  # the same low word
              (high << 32) | 0x2468ACE1,  # the same high word
              (0x13579BDF << 32) | (high ^ xor),  # its low word keys what the seed's high word keys
              ((low ^ xor) << 32) | 0x0F0F0F0F,  # and the other way round
              ((low ^ xor) << 32) | (high ^ xor)]  # both: the generators' seeds swapped (a + b repeated it)
    n = 200_000
    z = impl([torch.zeros(n)], 1.0, 1.0, seed)[0].double()
    for other in others:
        w = impl([torch.zeros(n)], 1.0, 1.0, other)[0].double()
        assert abs(float(torch.corrcoef(torch.stack([z, w]))[0, 1])) < 5 / n**0.5, hex(other)


@pytest.mark.parametrize("backend", ["reference", "native", "triton"])
def test_float64_sums_get_float64_noise(backend, monkeypatch):
    """The native and Triton kernels draw float32 normals: on a float64 sum the noise sat on float32's
    grid, so the sum's low bits showed through it and one release told neighbouring datasets apart
    (audit review). Float64 sums now get float64 normals on every backend; float32 sums keep the kernel."""
    monkeypatch.setenv("FASTDP_BACKEND", backend)
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        pytest.importorskip("triton")
    if ops.implementation("noisy_average", torch.device("cpu"))[0] != backend:
        pytest.skip(f"no {backend} noise kernel on the CPU here")
    wide, narrow = torch.zeros(4000, dtype=torch.float64), torch.zeros(4000)
    z64, z32 = ops.noisy_average([wide, narrow], 1.0, 1.0, 5)
    assert z64.dtype == torch.float64 and z32.dtype == torch.float32
    assert (z64.float().double() == z64).float().mean() < 0.01  # off float32's grid
    assert abs(z64.std().item() - 1) < 0.1 and abs(z32.std().item() - 1) < 0.1
    assert abs(float(torch.corrcoef(torch.stack([z64, z32.double()]))[0, 1])) < 0.1


def test_noise_kernels_refuse_float64_sums(tri):
    """The kernels draw float32 normals: called directly on a float64 sum (not through
    ops.noisy_average, which routes it to float64 normals) they released its low bits under noise
    on float32's grid (maintainability review). Each refuses it, the Philox reference too."""
    impls = {"native": native.noisy_average, "triton": tri["noise"].noisy_average_triton,
             "philox reference": tri["noise"].noisy_average_philox_ref}
    if cuda_native():
        impls["cuda-c++"] = cuda_native()
    for name, impl in impls.items():
        device = TRITON_DEVICE if name in ("triton", "cuda-c++") else "cpu"
        sums = [torch.zeros(8, device=device), torch.zeros(8, dtype=torch.float64, device=device)]
        with pytest.raises(ValueError, match="float64 sum's low bits"):
            impl(sums, 1.0, 1.0, 3)
        assert not sums[1].any(), name


def test_reference_noise_in_place_on_an_expanded_sum():
    """In place, the reference wrote into a tensor whose elements share memory and crashed (review)."""
    s = torch.ones(4, dtype=torch.float64).expand(3, 4)
    out = ops.noisy_average_ref([s], 1.0, 2.0, 7, inplace=True)[0]
    assert torch.equal(out, ops.noisy_average_ref([s], 1.0, 2.0, 7)[0])
    assert len(set(out.flatten().tolist())) == 12  # every element got its own noise


# --------------------------------------------------------------------------- norms


def _linear_inputs(batch, seq, d, p, dtype, strided):
    a = torch.randn(batch, seq, d, dtype=torch.float64).to(dtype)
    g = torch.randn(batch, seq, p, dtype=torch.float64).to(dtype)
    if strided:  # a (B, T, d) view with a non-unit inner stride
        a = torch.randn(batch, seq, 2 * d, dtype=torch.float64).to(dtype)[..., ::2]
    return a, g


@FAST
@given(batch=st.sampled_from([1, 2, 5]), seq=st.integers(1, 40), d=st.integers(1, 40), p=st.integers(1, 40),
       dtype=DTYPES, strided=st.booleans())
def test_linear_norm_kernels(tri, batch, seq, d, p, dtype, strided):
    a, g = _linear_inputs(batch, seq, d, p, dtype, strided)
    exact = ops.linear_sq_norms_direct_ref(a.double(), g.double())
    ln = tri["linear_norms"]
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    a, g = on_triton_device(a, g)
    for out in (ln.linear_sq_norms_ghost_triton(a, g, block_t=16, block_k=16),
                ln.linear_sq_norms_direct_triton(a, g, block_p=16, block_d=16, block_t=16)):
        assert out.dtype == torch.float64 and out.shape == (batch,)
        assert rel_err(out.cpu(), exact) < tol


def test_linear_norm_kernels_large_batch_and_default_blocks(tri):
    a, g = _linear_inputs(64, 5, 7, 3, torch.float32, False)
    exact = ops.linear_sq_norms_direct_ref(a.double(), g.double())
    ln = tri["linear_norms"]
    a, g = on_triton_device(a, g)
    assert rel_err(ln.linear_sq_norms_ghost_triton(a, g).cpu(), exact) < 2e-6
    assert rel_err(ln.linear_sq_norms_direct_triton(a, g).cpu(), exact) < 2e-6
    empty = a[:0]
    assert ln.linear_sq_norms_ghost_triton(empty, g[:0]).shape == (0,)


@pytest.mark.skipif(CUDA, reason="views a sparse file: CPU tensors under the interpreter")
def test_norm_kernels_index_samples_past_2_31_elements(tri, tmp_path):
    """The Triton kernels formed ``i * stride`` in int32: a sample starting past element 2^31 was
    read at a wrapped address (its norm came out 0, and it escaped clipping) (review)."""
    batch, seq, dim = 3, 4, 8
    stride = 2**31 - 2**18  # below 2^31: Triton passes it as an int32
    offset = 2**20
    numel = offset + (batch - 1) * stride + seq * dim
    path = tmp_path / "sparse.bin"
    with open(path, "wb") as f:
        f.truncate(2 * numel)  # ~8.6 GB of float16, sparse: only the three samples are written
    storage = torch.from_file(str(path), shared=True, size=numel, dtype=torch.float16)
    g = storage.as_strided((batch, seq, dim), (stride, dim, 1), offset)
    g.copy_(torch.randn(batch, seq, dim).half())
    ids = torch.tensor([[1, 2, 1, 3]] * batch)
    exact = ops.embedding_sq_norms_ref(ids, g.double(), None)
    assert rel_err(tri["embedding_norms"].embedding_sq_norms_triton(ids, g, None), exact) < 1e-3
    other = torch.randn(batch, seq, 5).half()
    exact = ops.linear_sq_norms_direct_ref(g.double(), other.double())
    ln = tri["linear_norms"]
    assert rel_err(ln.linear_sq_norms_ghost_triton(g, other), exact) < 1e-3
    assert rel_err(ln.linear_sq_norms_direct_triton(g, other), exact) < 1e-3
    del g, storage


def test_normals_reach_beyond_the_old_truncation():
    """Box-Muller's radius takes a 39-bit uniform (31 bits of one word, 8 of the other), so the
    largest normal is sqrt(-2 ln 2^-39) = 7.353; with 31 bits it was 6.556, a truncation of the
    Gaussian worth ~1e-10 sqrt(d) / sigma of delta per step (review)."""
    kn = pytest.importorskip("kernels.noise")
    z0, _ = kn.box_muller_ref(torch.tensor([0, 0, 2]), torch.tensor([0, 255, 0]))  # angle 0: z0 = r
    want = [math.sqrt(-2 * math.log(k * 2.0**-39)) for k in (1, 256, 256 + 1)]
    torch.testing.assert_close(z0.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)


def test_ghost_norms_survive_cancellation(tri):
    """Every ghost implementation forms its Grams in float64: the norm of a sample whose terms
    cancel to 1e-6 of their size is still right within float64's a-priori bound, (2d + T^2)
    u (sum_s |a_s||g_s|)^2 / norm ~ 7e-7 here (float32 Grams: off by ~200 %, or negative)."""
    a, g = cancelling_linear_inputs()
    exact = ops.linear_sq_norms_direct_ref(a.double(), g.double())
    assert 1e-7 < exact.item() < 1e-5
    for ghost in (ops.linear_sq_norms_ghost_ref, native.linear_sq_norms_ghost,
                  tri["linear_norms"].linear_sq_norms_ghost_triton):
        out = ghost(*on_triton_device(a, g)).cpu()
        assert rel_err(out, exact) < 1e-6, ghost


@FAST
@given(batch=st.sampled_from([1, 3, 40]), seq=st.integers(1, 24), dim=st.integers(1, 70), vocab=st.integers(1, 6),
       padding=st.sampled_from([None, 0, 2]), dtype=DTYPES)
def test_embedding_norm_kernels(tri, batch, seq, dim, vocab, padding, dtype):
    ids = torch.randint(0, vocab, (batch, seq))
    g = torch.randn(batch, seq, dim, dtype=torch.float64).to(dtype)
    exact = ops.embedding_sq_norms_ref(ids, g.double(), padding)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for out in (native.embedding_sq_norms(ids, g, padding),
                tri["embedding_norms"].embedding_sq_norms_triton(*on_triton_device(ids, g), padding, block_d=32).cpu()):
        assert out.dtype == torch.float64 and out.shape == (batch,)
        torch.testing.assert_close(out, exact, rtol=tol, atol=1e-300)


def test_embedding_norm_all_padding():
    ids = torch.zeros(3, 5, dtype=torch.long)
    assert torch.equal(native.embedding_sq_norms(ids, torch.randn(3, 5, 4), 0), torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("backend", ["reference", "native"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_norms_accumulate_in_float32(use_backend, backend, dtype):
    """Squares and per-sample gradients of half-precision inputs are formed in float32: in
    float16 a row of ten 300s squared to Inf (review), and a per-sample gradient entry of
    3 * 300^2 overflowed the direct route's float16 product."""
    use_backend(backend)
    x, y = torch.full((2, 10), 300.0, dtype=dtype), torch.full((2, 4), 300.0, dtype=dtype)
    a, g = torch.full((2, 3, 10), 300.0, dtype=dtype), torch.full((2, 3, 4), 300.0, dtype=dtype)
    want_row, want_outer = torch.full((2,), 9e5, dtype=torch.float64), torch.full((2,), 9e5 * 3.6e5, dtype=torch.float64)
    want_seq = torch.full((2,), 9.0 * 10 * 4 * 300.0**4, dtype=torch.float64)
    torch.testing.assert_close(ops.sample_sq_norms(x), want_row, rtol=1e-6, atol=0)
    torch.testing.assert_close(ops.outer_sq_norms(x, y)[0], want_outer, rtol=1e-6, atol=0)
    for route in (ops.linear_sq_norms_direct, ops.linear_sq_norms_ghost):
        torch.testing.assert_close(route(a, g), want_seq, rtol=1e-6, atol=0)


def test_squared_norms_of_finite_samples_past_float32s_square_range(tri):
    """A finite float32 sample whose per-sample gradient norm passes 1.8e19 gets its true
    squared norm (float64) from every route and backend: squared in float32 it was Inf, so the
    engine refused the step as non-finite or, skipping, dropped the sample instead of clipping
    it (review)."""
    torch.manual_seed(0)
    a, g = torch.randn(3, 20, 6), torch.randn(3, 20, 5)
    a[1] *= 1e12
    g[1] *= 1e12
    ids, rows = torch.randint(0, 4, (3, 20)), g * 1e9
    want_linear = ops.linear_sq_norms_direct_ref(a.double(), g.double())
    want_rows = (g.double() * 1e9).square().sum((1, 2))
    want_embedding = ops.embedding_sq_norms_ref(ids, rows.double(), None)
    assert want_linear[1] > 1e40 and want_rows[1] > 1e40 and want_embedding[1] > 1e40
    tl, te = tri["linear_norms"], tri["embedding_norms"]
    for name, route, args, want in [
        ("direct", (ops.linear_sq_norms_direct_ref, native.linear_sq_norms_direct,
                    tl.linear_sq_norms_direct_triton), (a, g), want_linear),
        ("ghost", (ops.linear_sq_norms_ghost_ref, native.linear_sq_norms_ghost,
                   tl.linear_sq_norms_ghost_triton), (a, g), want_linear),
        ("rows", (ops.sample_sq_norms_ref, native.sample_sq_norms), (rows,), want_rows),
        ("embedding", (ops.embedding_sq_norms_ref, native.embedding_sq_norms,
                       te.embedding_sq_norms_triton), (ids, rows, None), want_embedding),
    ]:
        for op in route:
            device_args = [on_triton_device(x)[0] if torch.is_tensor(x) else x for x in args]
            out = op(*(device_args if op.__module__.startswith("kernels") else args)).cpu()
            assert rel_err(out, want) < 1e-6, (name, op.__qualname__, out)


def test_triton_direct_route_takes_mixed_dtypes(tri):
    a, g = torch.randn(2, 5, 7, dtype=torch.float64), torch.randn(2, 5, 3)
    exact = ops.linear_sq_norms_direct_ref(a, g.double())
    out = tri["linear_norms"].linear_sq_norms_direct_triton(*on_triton_device(a, g)).cpu()
    assert rel_err(out, exact) < 1e-12


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_noisy_average_refuses_a_negative_or_nan_std_and_a_nonpositive_divisor(use_backend, backend):
    """The reference added no noise for std < 0 or NaN where the kernels drew it (review):
    every backend now refuses such settings instead of disagreeing."""
    use_backend(backend)
    sums = [torch.zeros(4)]
    for std, divisor in [(-1.0, 1.0), (math.nan, 1.0), (math.inf, 1.0), (1.0, 0.0), (1.0, -2.0), (1.0, math.nan)]:
        with pytest.raises(ValueError, match="noise std|divisor"):
            ops.noisy_average(sums, std, divisor, seed=1)
    assert torch.equal(sums[0], torch.zeros(4))


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_noisy_average_refuses_a_std_whose_draws_overflow_float32(use_backend, backend):
    """s + std z is formed in float32 before the division: std 1e38 (a divisor of 1e6 bringing each
    coordinate back in range) gave Inf entries on every backend (Triton review). Refused for non-float64
    sums, with nothing written; float64 sums take it."""
    use_backend(backend)
    sums = [torch.zeros(20000)]
    with pytest.raises(ValueError, match="overflow float32"):
        ops.noisy_average(sums, ops.FLOAT32_NOISE_STD_MAX * 1.01, 1e6, seed=1, inplace=True)
    assert torch.equal(sums[0], torch.zeros(20000))
    out = ops.noisy_average(sums, ops.FLOAT32_NOISE_STD_MAX, 1e6, seed=1)[0]
    assert torch.isfinite(out).all() and out.abs().max() > 1e30
    assert torch.isfinite(ops.noisy_average([torch.zeros(20000, dtype=torch.float64)], 1e38, 1e6, seed=1)[0]).all()


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_noisy_average_forms_half_precision_noise_in_float32(use_backend, backend):
    """A std above float16's 65504 with a divisor bringing it back in range: the kernels form the
    noise in float32; the reference rounded std to float16 and raised (Triton review follow-up)."""
    use_backend(backend)
    for inplace in (False, True):
        s = torch.zeros(4096, dtype=torch.float16)
        out = ops.noisy_average([s], 1e5, 1e3, seed=3, inplace=inplace)[0]
        assert out.dtype == torch.float16 and torch.isfinite(out).all()
        assert 80 < float(out.float().std()) < 120  # std 1e5 / 1e3


def test_gpu_noise_wrappers_refuse_scalars_float32_cannot_hold():
    """The Triton and CUDA noise kernels take std and divisor as float32: a divisor below
    1.4e-45 became 0 there (Inf gradients), a std above 3.4e38 Inf."""
    pytest.importorskip("triton")
    from kernels import dispatch
    for std, divisor in [(1.0, 1e-40), (1e39, 1.0), (1e38, 1e6), (1.0, 1e39)]:
        with pytest.raises(ValueError, match="float32's normal range"):
            dispatch._noisy_average([torch.zeros(4)], std, divisor, seed=1)
        with pytest.raises(ValueError, match="float32's normal range"):
            ops.check_float32_noise_scalars(std, divisor)
    ops.check_float32_noise_scalars(0.0, 1.0)


def test_embedding_reference_sums_half_precision_in_float32():
    ids = torch.zeros(2, 3, dtype=torch.long)
    g = torch.full((2, 3, 4), 300.0, dtype=torch.float16)  # three rows of one id: 900 per entry
    out = ops.embedding_sq_norms_ref(ids, g, None)
    torch.testing.assert_close(out, torch.full((2,), 4 * 900.0**2, dtype=torch.float64), rtol=1e-12, atol=0)


def test_group_norm_reference_input_gradient_for_channels_last_input():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 3, 5, dtype=torch.float64).to(memory_format=torch.channels_last)
    gn = torch.nn.GroupNorm(2, 4).double()
    leaf = x.detach().clone().requires_grad_(True)
    out = gn(leaf)
    g = torch.randn_like(out)
    (want,) = torch.autograd.grad(out, leaf, g)
    mean, rstd = torch.ops.aten.native_group_norm(x, gn.weight, gn.bias, 2, 4, 15, 2, gn.eps)[1:]
    grad_x = ops.group_norm_backward_ref(g, x, mean, rstd, gn.weight, 2, True)[0]
    torch.testing.assert_close(grad_x, want, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- dispatch


def test_auto_uses_native_on_cpu(monkeypatch):
    monkeypatch.delenv("FASTDP_BACKEND", raising=False)
    assert ops.implementation("noisy_average", torch.device("cpu"))[0] == "native"
    assert ops.implementation("embedding_sq_norms", torch.device("cpu"))[0] == "native"


@pytest.mark.parametrize("forced", ["native", None])
def test_missing_backend_warns_once(monkeypatch, forced):
    """A forced backend, or the default C++ one, that cannot be imported: one warning, then the
    references (without FASTDP_BACKEND a missing extension fell back silently: review)."""
    if forced:
        monkeypatch.setenv("FASTDP_BACKEND", forced)
    else:
        monkeypatch.delenv("FASTDP_BACKEND", raising=False)
    for name, value in (("_backends_loaded", False), ("_REGISTRY", {}), ("_CHOICES", {}), ("_LOAD_ERRORS", {}),
                        ("_WARNED", set()), ("_DEFAULT_MODULES", ("fastdp._no_such_ext",)),
                        ("_BACKEND_MODULES", {"native": ("fastdp._no_such_ext",), "triton": ("kernels._nope",)})):
        monkeypatch.setattr(ops, name, value)
    a, g = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ops.linear_sq_norms_ghost(a, g)
        ops.noisy_average([a], 1.0, 1.0, 0)
    assert len(caught) == 1 and "native kernels are unavailable from fastdp._no_such_ext" in str(caught[0].message)
    assert "the operations those modules implement use the PyTorch references" in str(caught[0].message)
    torch.testing.assert_close(out, ops.linear_sq_norms_ghost_ref(a, g))


def test_a_stale_extension_build_is_refused():
    """An in-place build older than the sources crashed in backward on a missing binding (review)."""
    import subprocess
    import sys
    code = ("import sys, types; stub = types.ModuleType('fastdp._C'); stub.BINDINGS = 1; "
            "sys.modules['fastdp._C'] = stub\n"
            "try:\n    import fastdp._native_ops\nexcept ImportError as e:\n    print('refused:', e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("refused:") and "rebuild it" in out and "missing noisy_average" in out


# --------------------------------------------------------------------------- GPU only

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("shape", [(64, 200, 300, 129), (3, 1000, 64, 700), (512, 16, 784, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_linear_norm_kernels_realistic_shapes_on_gpu(tri, shape, dtype):
    """Default tile sizes at sizes the engine meets; float32 needs ~1e-5 (no TF32)."""
    a, g = _linear_inputs(*shape, dtype, False)
    exact = ops.linear_sq_norms_direct_ref(a.double(), g.double())
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-4}[dtype]
    ln = tri["linear_norms"]
    a, g = on_triton_device(a, g)
    assert rel_err(ln.linear_sq_norms_ghost_triton(a, g).cpu(), exact) < tol
    assert rel_err(ln.linear_sq_norms_direct_triton(a, g).cpu(), exact) < tol


@gpu
def test_gpu_noise_kernels_match_stream_at_scale(tri):
    """Millions of elements over 300 tensors: same numbers as the CPU kernel, on every element."""
    gen = torch.Generator().manual_seed(5)
    sizes = [1 << 22] + torch.randint(1, 5000, (299,), generator=gen).tolist()
    sums = [torch.randn(n, generator=gen) for n in sizes]
    want = native.noisy_average(sums, 1.7, 3.0, 2**63 + 9)
    for impl in filter(None, (tri["noise"].noisy_average_triton, cuda_native())):
        got = impl(on_triton_device(*sums), 1.7, 3.0, 2**63 + 9)
        for o, w in zip(got, want):
            torch.testing.assert_close(o.cpu(), w, rtol=2e-6, atol=2e-6)


@gpu
def test_cuda_dispatch_and_forced_backends(monkeypatch):
    if cuda_native() is None:
        pytest.skip("fastdp/_cuda_noise.so is not built (make cuda-lib)")
    monkeypatch.delenv("FASTDP_BACKEND", raising=False)
    chosen = {op: ops.implementation(op, torch.device("cuda"))[0] for op in ops._REFERENCE}
    assert chosen == {"linear_sq_norms_ghost": "reference", "linear_sq_norms_direct": "reference",
                      "embedding_sq_norms": "triton", "noisy_average": "native",
                      "conv_sq_norms": "reference", "group_norm_backward": "reference",
                      "sample_sq_norms": "reference", "outer_sq_norms": "reference",
                      "total_sq_norms": "reference", "clip_factors": "reference"}
    monkeypatch.setenv("FASTDP_BACKEND", "native")
    assert ops.implementation("noisy_average", torch.device("cuda"))[0] == "native"
    monkeypatch.setenv("FASTDP_BACKEND", "triton")
    for op in ("noisy_average", "linear_sq_norms_ghost", "linear_sq_norms_direct", "embedding_sq_norms"):
        assert ops.implementation(op, torch.device("cuda"))[0] == "triton"


def test_triton_kernels_launch_with_their_tensors_gpu_current(monkeypatch):
    """Triton launches on the current device and its stream: a model on cuda:1 in a thread whose
    current device is 0 ran its kernels against the wrong GPU (kernel review, by reading). Every
    CUDA registration enters its first tensor's device; checked here with a recording stand-in."""
    pytest.importorskip("triton")
    dispatch = importlib.import_module("kernels.dispatch")
    entered = []

    class Recorder:
        def __init__(self, device):
            entered.append(device)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", Recorder)
    on_gpu1 = type("OnGpu1", (), {"device": torch.device("cuda", 1)})()
    run = dispatch._on_operands_gpu(lambda first, *args: len(entered))
    assert run([on_gpu1], 1.0) == 1 and run(on_gpu1, None) == 2
    assert entered == [torch.device("cuda", 1)] * 2
    for op, (kernel, _) in dispatch._KERNELS.items():
        registered = ops._REGISTRY[op][("triton", "cuda")]
        assert registered.__wrapped__ is kernel, op
