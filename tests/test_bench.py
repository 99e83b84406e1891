"""Smoke test of ``fastdp bench --quick``: the JSON has the expected structure (no timings asserted)."""
import json
import math

import pytest
import torch

from fastdp.cli import main

CONFIGS = ("mlp", "wide-linear")
METHODS = ("nonprivate", "fastdp-reference", "loop", "bf16-nonprivate", "bf16-fastdp", "ddp2-fastdp")


def test_bench_quick_json(tmp_path, capsys):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    assert main(["bench", "--quick", "--configs", ",".join(CONFIGS), "--methods", ",".join(METHODS[1:]),
                 "--json", str(out), "--markdown", str(md)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["quick"] is True and data["meta"]["memory_method"]
    assert data["meta"]["command"].startswith("fastdp bench --quick")
    assert set(data["configs"]) == set(CONFIGS)
    rows = {(r["config"], r["method"]): r for r in data["results"]}
    assert set(rows) == {(c, m) for c in CONFIGS for m in METHODS}
    for key, r in rows.items():
        assert r["status"] == "ok", r
        assert r["steps"] >= 1 and r["step_ms"] > 0
        for ratio in ("time_ratio", "mem_ratio"):
            assert math.isfinite(r[ratio]) and r[ratio] > 0, (key, ratio, r[ratio])
        if key[1] == "nonprivate":
            assert r["time_ratio"] == 1.0 and r["mem_ratio"] == 1.0
        if key[1] == "bf16-fastdp":  # against the bf16 non-private step, not the float32 one (bench audit)
            bf16 = rows[(key[0], "bf16-nonprivate")]
            assert r["time_ratio"] == r["step_ms"] / bf16["step_ms"]
            assert r["mem_ratio"] == r["peak_mb"] / bf16["peak_mb"]
    assert rows[("wide-linear", "fastdp-reference")]["ops"]["linear_sq_norms_ghost"] == "reference"
    assert "| wide-linear | loop |" in md.read_text()
    assert "| mlp | fastdp-reference |" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_bench_on_cuda_without_a_gpu_is_a_message():
    """An AssertionError traceback from torch.cuda (checkpoint review)."""
    with pytest.raises(SystemExit, match="--device cuda, but this torch sees no CUDA GPU"):
        main(["bench", "--quick", "--device", "cuda"])


def test_bench_rejects_unknown_method():
    with pytest.raises(SystemExit, match="unknown method"):
        main(["bench", "--methods", "nope"])


@pytest.mark.parametrize("option", ["--threads", "--min-time", "--budget"])
def test_bench_rejects_non_positive_settings(capsys, option):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--quick", option, "0"])
    assert exit_info.value.code == 2 and f"argument {option}: expected a positive" in capsys.readouterr().err


def test_kernel_microbenchmarks_run_once():
    """bench/test_kernel_benchmarks.py (pytest-benchmark), each case run once without timing:
    its rows compute the same numbers and none of them is broken."""
    import subprocess
    import sys
    from pathlib import Path

    bench_file = Path(__file__).resolve().parents[1] / "bench" / "test_kernel_benchmarks.py"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable",
                           str(bench_file)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
