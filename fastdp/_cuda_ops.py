"""CUDA C++ kernels (``csrc/*.cu``), registered as backend ``"native"`` on ``"cuda"``.

The CUDA sources build into the plain shared library ``fastdp/_cuda_noise.so`` (``make
cuda-lib``; no torch headers) and are called through ctypes on torch's current stream.
On a machine without CUDA this module registers nothing; with CUDA but without the
library, importing it raises ImportError, so ``FASTDP_BACKEND=native`` warns once and
falls back (see :func:`fastdp.ops._load_backends`). Importing creates no CUDA context: the
first call on each GPU makes one probe launch, so a library built for another GPU is
found there, with one warning, and the PyTorch reference runs instead.

The noise kernel is the default for CUDA tensors (the Triton one is forced-only): on an
H100 it took 1.5-1.7x a plain copy and ran 1.7-23x faster than the PyTorch composite
(``bench/kernels_table.py --cuda``; numbers in ``bench/RESULTS.md``).
"""
from __future__ import annotations

import ctypes
import warnings
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from fastdp import ops
from fastdp.callers import user_stacklevel

LIBRARY = Path(__file__).with_name("_cuda_noise.so")
GROUP = 256  # elements per Philox counter group / 4, as in csrc/philox.h and kernels/noise.py


def _load() -> ctypes.CDLL:
    if not LIBRARY.exists():
        raise ImportError(f"{LIBRARY.name} is not built: run `make cuda-lib` (needs nvcc)")
    lib = ctypes.CDLL(str(LIBRARY))
    if not hasattr(lib, "fastdp_noisy_average_f32"):
        raise ImportError(f"{LIBRARY.name} was built from older sources; rebuild it (make cuda-lib)")
    lib.fastdp_noisy_average_f32.restype = ctypes.c_int
    lib.fastdp_noisy_average_f32.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                                             ctypes.c_uint64, ctypes.c_double, ctypes.c_double, ctypes.c_void_p]
    if lib.fastdp_noise_group() != GROUP:
        raise ImportError(f"{LIBRARY.name} was built with another group size; rebuild it (make cuda-lib)")
    return lib


def noisy_average(sums: Sequence[torch.Tensor], std: float, divisor: float, seed: int,
                  inplace: bool = False) -> List[torch.Tensor]:
    """Fused ``(s + std z) / divisor`` in float32, one launch; stream k = position in ``sums``. Float64
    sums are refused (``ops.noisy_average`` gives them float64 normals)."""
    ops.check_float32_sums(sums)
    if not _runs_on(sums[0].device):
        return ops.noisy_average_ref(sums, std, divisor, seed, inplace=inplace)
    return _launch(sums, std, divisor, seed, inplace)


def _launch(sums: Sequence[torch.Tensor], std: float, divisor: float, seed: int,
            inplace: bool) -> List[torch.Tensor]:
    ops.check_float32_noise_scalars(std, divisor)
    srcs = [ops.kernel_operand(s, torch.float32) for s in sums]
    outs = srcs if inplace else [torch.empty_like(s) for s in srcs]
    members = [k for k, s in enumerate(srcs) if s.numel()]
    if members:
        rows, first = [], 0
        for k in members:
            rows.append([srcs[k].data_ptr(), outs[k].data_ptr(), srcs[k].numel(), k, first])
            first += -(-srcs[k].numel() // (4 * GROUP))
        device = srcs[members[0]].device
        # non_blocking from pageable memory: staged before returning, and no stream sync
        table = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        blocks = 8 * torch.cuda.get_device_properties(device).multi_processor_count
        stream = torch.cuda.current_stream(device).cuda_stream
        with torch.cuda.device(device):  # a launch goes to the current device, which must own the stream
            err = _LIB.fastdp_noisy_average_f32(table.data_ptr(), len(members), first, blocks, seed & (2**64 - 1),
                                                float(std), float(divisor), stream)
        if err:
            raise RuntimeError(f"fastdp CUDA noise kernel failed to launch (cudaError {err})")
    return ops.in_input_dtypes(outs, sums)


_RUNS: Dict[int, bool] = {}  # device index -> the probe launch worked there


def _runs_on(device: torch.device) -> bool:
    """One tiny launch the first time a GPU is used, so a library built for another GPU is
    caught once (with a warning) rather than failing in the middle of training."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _RUNS:
        probe = torch.arange(4.0, device=device)
        try:
            torch.testing.assert_close(_launch([probe], 0.0, 2.0, 0, False)[0], probe / 2)
            torch.cuda.synchronize(device)
            _RUNS[index] = True
        except Exception as exc:
            warnings.warn(f"fastdp: {LIBRARY.name} does not run on {torch.cuda.get_device_name(device)} ({exc}); "
                          "using the PyTorch noise reference. Rebuild it there: make cuda-lib",
                          RuntimeWarning, stacklevel=user_stacklevel())
            _RUNS[index] = False
    return _RUNS[index]


if torch.cuda.is_available():
    _LIB = _load()
    ops.register("noisy_average", "native", "cuda")(noisy_average)
