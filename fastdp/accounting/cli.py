"""``fastdp epsilon`` and ``fastdp calibrate``: privacy accounting from the command line."""
from __future__ import annotations

import argparse
import math
import sys

from .base import available_accountants
from .calibrate import calibrate_noise, epsilon

__all__ = ["register"]


def _add_schedule(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sample-rate", "-q", type=float, required=True, help="Poisson sampling rate q in [0, 1]")
    parser.add_argument("--steps", "-T", type=int, required=True, help="number of training steps")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta, 0 < delta < 1 (default 1e-5)")


def _round_up(value: float, digits: int = 6) -> float:
    """Round a positive number up to ``digits`` significant digits."""
    if value <= 0 or not math.isfinite(value):
        return value
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(value)))
    rounded = math.ceil(value * scale) / scale
    return float(f"{rounded:.{digits}g}") if float(f"{rounded:.{digits}g}") >= value else rounded


def _run_epsilon(args: argparse.Namespace) -> int:
    names = available_accountants() if args.accountant == "both" else [args.accountant]
    names = sorted(names, key=lambda n: n != "pld")  # tight one first
    try:
        for name in names:
            eps = epsilon(args.noise_multiplier, args.sample_rate, args.steps, args.delta, accountant=name)
            print(f"epsilon ({name}): {eps:.6g}  [delta={args.delta:g}]")
    except (ValueError, OverflowError) as exc:  # OverflowError: a float past float64's range
        print(f"fastdp epsilon: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _run_calibrate(args: argparse.Namespace) -> int:
    try:
        sigma = calibrate_noise(
            args.target_epsilon, args.delta, args.sample_rate, args.steps, accountant=args.accountant,
            sigma_max=args.sigma_max,
        )
        sigma = _round_up(sigma)  # what is printed must still meet the target
        eps = epsilon(sigma, args.sample_rate, args.steps, args.delta, accountant=args.accountant)
    except (ValueError, OverflowError) as exc:  # OverflowError: a float past float64's range
        print(f"fastdp calibrate: error: {exc}", file=sys.stderr)
        return 2
    print(f"noise multiplier: {sigma!r}")
    print(f"epsilon ({args.accountant}): {eps:.6g} <= {args.target_epsilon:g}  [delta={args.delta:g}]")
    return 0


def register(subparsers) -> None:
    """Add the ``epsilon`` and ``calibrate`` commands to an argparse sub-parsers object."""
    p_eps = subparsers.add_parser(
        "epsilon",
        help="epsilon of a DP-SGD schedule",
        description="Print epsilon after STEPS Poisson-subsampled Gaussian steps (add/remove neighbours).",
    )
    p_eps.add_argument("--noise-multiplier", "--sigma", type=float, required=True, help="noise multiplier sigma >= 0")
    _add_schedule(p_eps)
    p_eps.add_argument(
        "--accountant",
        choices=["both"] + available_accountants(),
        default="both",
        help="pld (tight), rdp (reference) or both (default)",
    )
    p_eps.set_defaults(func=_run_epsilon)

    p_cal = subparsers.add_parser(
        "calibrate",
        help="the noise multiplier meeting a target epsilon",
        description="Print a noise multiplier whose epsilon does not exceed --target-epsilon and is within "
                    "0.5 % of it (the smallest such, to that tolerance).",
    )
    p_cal.add_argument("--target-epsilon", type=float, required=True, help="target epsilon > 0")
    _add_schedule(p_cal)
    p_cal.add_argument("--accountant", choices=available_accountants(), default="pld", help="default: pld")
    p_cal.add_argument("--sigma-max", type=float, default=1e4,
                       help="the largest noise multiplier searched (default 1e4)")
    p_cal.set_defaults(func=_run_calibrate)
