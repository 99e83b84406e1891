"""fastdp.keep_freed_memory: glibc's mmap and trim thresholds raised so freed buffers are reused."""
import ctypes
import sys

import pytest

from fastdp import allocator, keep_freed_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_sets_the_thresholds_on_glibc(monkeypatch):
    calls = []
    real = ctypes.CDLL("libc.so.6").mallopt

    class Libc:  # records what keep_freed_memory asks of the real mallopt
        @property
        def mallopt(self):
            def record(param, value):
                calls.append((param, value))
                return real(param, value)
            record.argtypes = record.restype = None
            return record

    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: Libc())
    assert keep_freed_memory() is True
    assert calls == [(allocator.M_MMAP_THRESHOLD, 32 << 20), (allocator.M_TRIM_THRESHOLD, 2**31 - 1)]


def test_is_a_no_op_without_glibc(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(allocator.ctypes, "CDLL", missing)
    assert keep_freed_memory() is False
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert keep_freed_memory() is False

