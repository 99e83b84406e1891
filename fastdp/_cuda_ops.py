"""CUDA C++ kernels (``csrc/*.cu``), registered as backend ``"native"`` on ``"cuda"``.

The CUDA sources build into the plain shared library ``fastdp/_cuda_noise.so`` (``make
cuda-lib``; no torch headers) and are called through ctypes on torch's current stream.
On a machine without CUDA this module registers nothing; with CUDA but without the
library, importing it raises ImportError, so ``FASTDP_BACKEND=native`` warns once and
falls back (see :func:`fastdp.ops._load_backends`).

The noise kernel is the default for CUDA tensors (the Triton one is forced-only): on an
H100 it took 1.5-1.7x a plain copy and ran 1.7-23x faster than the PyTorch composite
(``bench/kernels_table.py --cuda``; numbers in ``bench/RESULTS.md``). A library built
for another GPU is caught at import by one probe launch.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import List, Sequence

import torch

from fastdp import ops

LIBRARY = Path(__file__).with_name("_cuda_noise.so")
GROUP = 256  # elements per Philox counter group / 4, as in csrc/philox.h and kernels/noise.py
_FLOATS = (torch.float32, torch.float64)


def _load() -> ctypes.CDLL:
    if not LIBRARY.exists():
        raise ImportError(f"{LIBRARY.name} is not built: run `make cuda-lib` (needs nvcc)")
    lib = ctypes.CDLL(str(LIBRARY))
    lib.fastdp_noisy_average.restype = ctypes.c_int
    lib.fastdp_noisy_average.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_uint64, ctypes.c_double, ctypes.c_double, ctypes.c_void_p]
    if lib.fastdp_noise_group() != GROUP:
        raise ImportError(f"{LIBRARY.name} was built with another group size; rebuild it (make cuda-lib)")
    return lib


def noisy_average(sums: Sequence[torch.Tensor], std: float, divisor: float, seed: int,
                  inplace: bool = False) -> List[torch.Tensor]:
    """Fused ``(s + std z) / divisor``, one launch per dtype; stream k = position in ``sums``."""
    srcs = [s.detach().contiguous() if s.dtype in _FLOATS else s.detach().float().contiguous() for s in sums]
    outs = srcs if inplace else [torch.empty_like(s) for s in srcs]
    for dtype in _FLOATS:
        members = [k for k, s in enumerate(srcs) if s.dtype == dtype and s.numel()]
        if not members:
            continue
        rows, first = [], 0
        for k in members:
            rows.append([srcs[k].data_ptr(), outs[k].data_ptr(), srcs[k].numel(), k, first])
            first += -(-srcs[k].numel() // (4 * GROUP))
        device = srcs[members[0]].device
        # non_blocking from pageable memory: staged before returning, and no stream sync
        table = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        blocks = 8 * torch.cuda.get_device_properties(device).multi_processor_count
        stream = torch.cuda.current_stream(device).cuda_stream
        err = _LIB.fastdp_noisy_average(table.data_ptr(), len(members), first, blocks, dtype == torch.float64,
                                        seed & (2**64 - 1), float(std), float(divisor), stream)
        if err:
            raise RuntimeError(f"fastdp CUDA noise kernel failed to launch (cudaError {err})")
    return [o if o.dtype == s.dtype else o.to(s.dtype) for o, s in zip(outs, sums)]


def _check_runs() -> None:
    """One tiny launch, so a library built for another GPU fails here (ImportError: the
    dispatcher falls back to the other backends) rather than in the middle of training."""
    probe = torch.arange(4.0, device="cuda")
    try:
        torch.testing.assert_close(noisy_average([probe], 0.0, 2.0, 0)[0], probe / 2)
        torch.cuda.synchronize()
    except Exception as exc:
        raise ImportError(f"{LIBRARY.name} does not run on this GPU ({exc}); rebuild it: make cuda-lib") from exc


if torch.cuda.is_available():
    _LIB = _load()
    _check_runs()
    ops.register("noisy_average", "native", "cuda")(noisy_average)
