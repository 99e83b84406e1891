"""fastdp: exact per-sample gradient clipping for DP-SGD at almost the cost of a plain step.

    optimizer = fastdp.DPOptimizer(torch.optim.AdamW(model.parameters()), module=model,
                                   noise_multiplier=1.0, max_grad_norm=1.0,
                                   expected_batch_size=256)

or, Opacus-style, ``model, optimizer, loader = fastdp.make_private(...)``.
"""
from fastdp import checkpoint
from fastdp.allocator import keep_freed_memory
from fastdp.data import BatchMemoryManager, PoissonBatchSampler, poisson_loader
from fastdp.distributed import DistributedDPOptimizer, distributed_poisson_loader
from fastdp.engine import GradSampleEngine, NonFiniteGradientError
from fastdp.layers import UnsupportedModuleError
from fastdp.optimizer import DPOptimizer
from fastdp.privacy import make_private
from fastdp.validate import find_problems, fix, validate

__version__ = "0.1.0"


def __getattr__(name: str):
    """``fastdp.accounting`` is imported on first use (it loads SciPy, about 0.8 s)."""
    if name == "accounting":
        import importlib
        return importlib.import_module("fastdp.accounting")
    raise AttributeError(f"module 'fastdp' has no attribute {name!r}")

__all__ = [
    "BatchMemoryManager", "DistributedDPOptimizer", "PoissonBatchSampler", "accounting", "checkpoint",
    "distributed_poisson_loader", "poisson_loader",
    "DPOptimizer", "GradSampleEngine", "NonFiniteGradientError", "UnsupportedModuleError",
    "find_problems", "fix", "keep_freed_memory", "make_private", "validate",
]
