"""The ``fastdp`` command line: ``fastdp <command> [options]``.

Each command lives beside the code it drives; a module listed in ``COMMAND_MODULES``
exposes ``register(subparsers)``, which adds its sub-parsers and sets ``func``.
"""
from __future__ import annotations

import argparse
import importlib
import math
import sys
import warnings
from typing import List, Optional


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0 (a seed)."""
    return _int_at_least(text, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def delta_float(text: str) -> float:
    """argparse type: a delta, a normal float strictly between 0 and 1 (``check_delta``)."""
    from fastdp.accounting.base import check_delta  # not at import: the package loads SciPy

    value = _float(text)
    try:
        return check_delta(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def momentum_float(text: str) -> float:
    """argparse type: a number in [0, 1) (an SGD momentum; 1 or more diverges)."""
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text}")
    return value


def _int_at_least(text: str, minimum: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


COMMAND_MODULES = (
    "fastdp.accounting.cli",  # epsilon, calibrate
    "fastdp.train",  # train
    "fastdp.bench",  # bench
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastdp", description="Differentially private training with exact per-sample clipping."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real import error inside the module
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    plain, warnings.formatwarning = warnings.formatwarning, _command_warning
    try:
        return int(args.func(args) or 0)
    finally:
        warnings.formatwarning = plain


def _command_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as a command-line user reads it: no source location (there is no user code)."""
    return f"fastdp: {category.__name__}: {message}\n"


if __name__ == "__main__":
    sys.exit(main())
