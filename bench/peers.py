"""Peers benchmark: DP-SGD step time and memory of fastdp, the per-example loop, torch.func
and Opacus against a non-private step. Same options as ``fastdp bench``; e.g.

    python bench/peers.py --markdown /tmp/peers.md --plot /tmp/peers.png   (a new file: --markdown overwrites it)
"""
import sys

from fastdp.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
