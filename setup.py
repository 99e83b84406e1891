"""Builds the native extension ``fastdp._C`` (pybind11, C++/OpenMP CPU kernels).

The extension needs no torch headers: kernels take NumPy views of CPU tensors, so
building never needs (or pulls) torch. CUDA sources in ``csrc/`` are compiled
separately (see ``make cuda-check``) because this build must work without a GPU.
"""
import os
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

sources = sorted(
    os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith(".cpp")
)
extra_compile = ["-O3", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno"]
extra_link = ["-fopenmp"]
if sys.platform == "darwin":  # Apple clang has no -fopenmp by default
    extra_compile.remove("-fopenmp")
    extra_link = []

setup(
    ext_modules=[
        Pybind11Extension(
            "fastdp._C",
            sources,
            cxx_std=17,
            extra_compile_args=extra_compile,
            extra_link_args=extra_link,
        )
    ],
    cmdclass={"build_ext": build_ext},
)
