"""fastdp.layout: which sample of a loader batch each row of a view of it holds."""
import itertools

import pytest
import torch

from fastdp.layout import UNKNOWN, SampleLayout


def _brute_rows(handed, x):
    """(start, step, count) of the rows of ``x`` from a label per element of ``handed``'s memory, None
    where they are not one sample each, UNKNOWN where they reach memory ``handed`` does not cover."""
    size = max(handed.untyped_storage().nbytes() // handed.element_size(), 1)
    labels = torch.full((size,), -1, dtype=torch.int64)
    ids = torch.arange(handed.shape[0]).view(-1, *[1] * (handed.dim() - 1)).expand(handed.shape)
    labels.as_strided(handed.shape, handed.stride(), handed.storage_offset()).copy_(ids)
    rows = labels.as_strided(x.shape, x.stride(), x.storage_offset()).reshape(x.shape[0], -1)
    if (rows < 0).any():
        return UNKNOWN
    first = rows[:, 0]
    if not (rows == first[:, None]).all():
        return None
    step = int(first[1] - first[0]) if len(first) > 1 else 1
    if step <= 0 or not torch.equal(first, first[0] + step * torch.arange(len(first))):
        return None
    return int(first[0]), step, len(first)


_VIEWS = {
    "itself": lambda h: h, "x[0]": lambda h: h[0], "x[1:3]": lambda h: h[1:3], "x[::2]": lambda h: h[::2],
    "x[:, 1]": lambda h: h[:, 1], "x[:, :, :2]": lambda h: h[:, :, :2], "transpose(0, 1)": lambda h: h.transpose(0, 1),
    "transpose(1, 2)": lambda h: h.transpose(1, 2), "x[:1].expand": lambda h: h[:1].expand(3, *h.shape[1:]),
    "unfold(1, 2, 1)": lambda h: h.unfold(1, 2, 1), "x[2:3]": lambda h: h[2:3], "x[0, :1]": lambda h: h[0, :1],
    "flatten": lambda h: h.reshape(-1, h.shape[-1]) if h.is_contiguous() else h[:, 0],
    "shifted one element": lambda h: h.as_strided((h.shape[0] - 1, *h.shape[1:]), h.stride(), h.storage_offset() + 1),
}


_THREE_D_ONLY = ("x[:, :, :2]", "transpose(1, 2)", "unfold(1, 2, 1)")


@pytest.mark.parametrize("handed,view", [(h, v) for h in ("stacked", "slice of stacked", "transposed collate",
                                                          "column-major")
                                         for v in sorted(_VIEWS) if h != "column-major" or v not in _THREE_D_ONLY])
def test_sample_layout_matches_a_label_per_element(handed, view):
    """SampleLayout.rows_of against labels written through the handed tensor's own strides: byte
    arithmetic (sample-major memory) and labels (interleaved) give the same rows, or None alike."""
    root = torch.randn(6, 4, 3) if handed in ("stacked", "slice of stacked") else torch.randn(4, 6, 3)
    tensor = {"stacked": lambda: root, "slice of stacked": lambda: root[1:5],
              "transposed collate": lambda: root.transpose(0, 1),
              "column-major": lambda: root.permute(2, 1, 0).contiguous().permute(2, 1, 0)[:, :, 0]}[handed]()
    x = _VIEWS[view](tensor)
    assert SampleLayout([tensor], 1).rows_of(x) == _brute_rows(tensor, x)


def _byte_labels(handed):
    """{byte offset: sample} over the handed tensors' memory (None where two samples claim a byte)."""
    labels = {}
    for t in handed:
        size = t.element_size()
        for index in itertools.product(*map(range, t.shape)):
            start = (t.storage_offset() + sum(i * s for i, s in zip(index, t.stride()))) * size
            for byte in range(start, start + size):
                labels[byte] = index[0] if labels.get(byte, index[0]) == index[0] else None
    return labels


def _brute_rows_by_bytes(handed, x):
    labels, size = _byte_labels(handed), x.element_size()
    rows = []
    for i in range(x.shape[0]):
        seen = set()
        for index in itertools.product(*map(range, x.shape[1:])):
            start = (x.storage_offset() + i * x.stride(0) + sum(j * s for j, s in zip(index, x.stride()[1:]))) * size
            seen.update(labels.get(byte, "free") for byte in range(start, start + size))
        if "free" in seen or None in seen:
            return UNKNOWN
        if len(seen) != 1:
            return None
        rows.append(seen.pop())
    step = rows[1] - rows[0] if len(rows) > 1 else 1
    return (rows[0], step, len(rows)) if step > 0 and rows == [rows[0] + step * i for i in range(len(rows))] else None


_BUFFERS = {  # (root, the tensors a collate hands out on its memory)
    "two halves (towers)": lambda: (lambda r: (r, [r[:3], r[3:]]))(torch.randn(6, 4)),
    "pair v[0], v[1] at B = 1": lambda: (lambda r: (r, [r[0], r[1]]))(torch.randn(2, 1, 4)),
    "interleaved pair": lambda: (lambda r: (r, [r[:-1].t(), r[1:].t()]))(torch.randn(5, 3)),
    "full and trimmed": lambda: (lambda r: (r, [r.t(), r.t()[:, :2]]))(torch.randn(5, 3)),
    "expanded positions": lambda: (lambda r: (r, [r.expand(3, 4)]))(torch.arange(4.0)),
    "complex, transposed": lambda: (lambda r: (r, [r.t()]))(torch.randn(4, 3, dtype=torch.complex64)),
    "empty batch": lambda: (lambda r: (r, [r.t()]))(torch.randn(4, 0)),
    "pair v[0], v[1] of a stack": lambda: (lambda r: (r, [r[0], r[1]]))(torch.randn(2, 3, 4)),
    "overlapping windows": lambda: (lambda r: (r, [r.unfold(0, 4, 2)]))(torch.randn(11)),
    "reals of complex": lambda: (lambda r: (r, [torch.view_as_real(r)]))(torch.randn(3, 4, dtype=torch.complex64)),
}
_BUFFER_VIEWS = {
    "first handed": lambda h: h[0], "first handed, time first": lambda h: h[0].transpose(0, 1) if h[0].dim() > 1
    else h[0][None], "first handed [1:]": lambda h: h[0][1:], "second handed": lambda h: h[-1],
    "first row": lambda h: h[0][:1], "as reals": lambda h: torch.view_as_real(h[0]) if h[0].is_complex() else h[0],
    "the whole buffer": lambda h: h[0] if h[0]._base is None else h[0]._base,
}


@pytest.mark.parametrize("buffer,view", [(b, v) for b in sorted(_BUFFERS) for v in sorted(_BUFFER_VIEWS)])
def test_sample_layout_of_several_handed_tensors_matches_bytes_labelled_one_by_one(buffer, view):
    """Several tensors of one batch on one memory (two towers' halves, a pair of views, a trimmed copy),
    shared memory (an expanded batch: unknown, as any tensor), dtype views and empty batches: rows_of
    against every byte labelled in a Python loop (regression review of the first version)."""
    _, handed = _BUFFERS[buffer]()
    x = _BUFFER_VIEWS[view](handed)
    got = SampleLayout(handed, 1).rows_of(x)
    want = (0, 1, 0) if x.shape[0] == 0 else UNKNOWN if x.numel() == 0 else _brute_rows_by_bytes(handed, x)
    assert got == want
