"""The engine on a GPU: clipped sums of every layer family against the per-example loop,
in float64 on CUDA, with each kernel backend. Skipped without a CUDA device (CI has none;
``bench/gpu_session.sh`` runs it on a lent GPU)."""
import pytest
import torch
from torch import nn

from fastdp import ops
from reference import check_exact

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("float64")]


class TinyLM(nn.Module):
    def __init__(self, vocab=50, dim=24):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, 40)
        self.head = nn.Linear(40, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.norm(self.emb(ids)))))


def _models():
    yield "mlp", lambda: nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 10)), [(17, 30)], None
    yield "seq-linear", lambda: nn.Sequential(nn.Linear(33, 70), nn.GELU(), nn.Linear(70, 5)), [(6, 90, 33)], None
    conv = lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),  # noqa: E731
                                 nn.Conv2d(8, 6, 3, stride=2), nn.Flatten(), nn.LazyLinear(4))
    yield "conv-gn", conv, [(5, 3, 12, 12)], None
    yield "embedding-lm", TinyLM, None, (7, 33)


@pytest.mark.parametrize("backend", ["reference", "triton", "native", "auto"])
@pytest.mark.parametrize("name,make,shapes,ids", list(_models()), ids=[m[0] for m in _models()])
def test_engine_exact_on_gpu(monkeypatch, backend, name, make, shapes, ids):
    monkeypatch.setenv("FASTDP_BACKEND", backend)
    torch.manual_seed(0)
    if ids is not None:
        inputs = [torch.randint(0, 50, ids, device="cuda")]
        inputs[0][:, :3] = 0  # some padding
    else:
        inputs = [torch.randn(s, device="cuda") for s in shapes]
    model = make().cuda()
    with torch.no_grad():
        model(*inputs)  # materialise lazy layers
    check_exact(model, inputs)


def test_gpu_noise_step_uses_kernel_and_is_scaled(monkeypatch):
    """A noisy step on CUDA: std sigma*C/B on the gradient, through the default backend."""
    import fastdp

    monkeypatch.delenv("FASTDP_BACKEND", raising=False)
    torch.manual_seed(0)
    model = nn.Linear(1000, 1000).cuda()
    opt = fastdp.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), module=model, noise_multiplier=2.0,
                             max_grad_norm=0.5, expected_batch_size=8)
    (model(torch.zeros(8, 1000, device="cuda")).sum() * 0).backward()
    opt.step()
    std = model.weight.grad.std().item()
    assert abs(std - 2.0 * 0.5 / 8) < 0.01 * (2.0 * 0.5 / 8)
    assert model.weight.grad.is_cuda
    opt.detach()


def test_bf16_autocast_conv_after_groupnorm():
    """Under CUDA autocast GroupNorm returns float32 while the next conv's grad is bfloat16:
    the input gradient must still be formed (one dtype for cuDNN) and match float32 closely."""
    import fastdp

    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),  # noqa: E731
                                 nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 64, 10))
    model = make().cuda().float()
    x = torch.randn(16, 3, 8, 8, device="cuda", dtype=torch.float32)
    grads = {}
    for autocast in (False, True):
        m = __import__("copy").deepcopy(model)
        opt = fastdp.DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), module=m, noise_multiplier=0.0,
                                 max_grad_norm=1e3, expected_batch_size=16, loss_reduction="sum")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            m(x).float().square().sum().backward()
        opt.step()
        grads[autocast] = torch.cat([p.grad.flatten() for p in m.parameters()])
        opt.detach()
    assert torch.isfinite(grads[True]).all()
    assert (grads[True] - grads[False]).norm() < 0.05 * grads[False].norm()
