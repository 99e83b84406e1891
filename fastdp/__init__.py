"""fastdp: exact per-sample gradient clipping for DP-SGD at almost the cost of a plain step."""
__version__ = "0.1.0"
