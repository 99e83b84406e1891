"""fastdp.layout: which sample of a loader batch each row of a view of it holds."""
import pytest
import torch


def _brute_rows(handed, x):
    """(start, step, count) of the rows of ``x`` from a label per element of ``handed``'s memory, or None."""
    size = max(handed.untyped_storage().nbytes() // handed.element_size(), 1)
    labels = torch.full((size,), -1, dtype=torch.int64)
    ids = torch.arange(handed.shape[0]).view(-1, *[1] * (handed.dim() - 1)).expand(handed.shape)
    labels.as_strided(handed.shape, handed.stride(), handed.storage_offset()).copy_(ids)
    rows = labels.as_strided(x.shape, x.stride(), x.storage_offset()).reshape(x.shape[0], -1)
    first = rows[:, 0]
    if (first < 0).any() or not (rows == first[:, None]).all():
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
    from fastdp.layout import SampleLayout

    root = torch.randn(6, 4, 3) if handed in ("stacked", "slice of stacked") else torch.randn(4, 6, 3)
    tensor = {"stacked": lambda: root, "slice of stacked": lambda: root[1:5],
              "transposed collate": lambda: root.transpose(0, 1),
              "column-major": lambda: root.permute(2, 1, 0).contiguous().permute(2, 1, 0)[:, :, 0]}[handed]()
    base = tensor if tensor._base is None else tensor._base
    layout = SampleLayout(tensor, base)
    x = _VIEWS[view](tensor)
    want = _brute_rows(tensor, x)
    got = layout.rows_of(x)
    if want is None:
        assert got is None
    else:  # the same samples, counted from the root's first row or the handed tensor's
        assert got is not None and got[1:] == want[1:] and got[0] - want[0] == layout.rows_of(tensor)[0]
