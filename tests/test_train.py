"""``fastdp train``: a short DP-SGD run on Fashion-MNIST, the digits smoke run, data loading."""
import gzip
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from fastdp import accounting
from fastdp.cli import main
from fastdp.datasets import DatasetNotFoundError, load_dataset, read_idx
from fastdp.train import MaxPool2x2Stride1, TrainConfig, build_model, train

KEYS = {"test_accuracy", "epsilon", "delta", "noise_multiplier", "sample_rate", "steps",
        "accountant", "wall_seconds"}


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run(tmp_path, *args):
    """One ``fastdp train`` run on one thread (tiny batches; robust on a busy machine)."""
    path = tmp_path / "metrics.json"
    assert main(["train", "--no-progress", "--threads", "1", "--metrics-json", str(path), *args]) == 0
    return json.loads(path.read_text())


def _check_privacy(metrics, target_epsilon):
    recomputed = accounting.epsilon(
        noise_multiplier=metrics["noise_multiplier"], sample_rate=metrics["sample_rate"],
        steps=metrics["steps"], delta=metrics["delta"], accountant=metrics["accountant"],
    )
    assert metrics["epsilon"] == pytest.approx(recomputed, rel=1e-3)
    # calibrated to spend the target, not much less and never more
    assert 0.9 * target_epsilon <= metrics["epsilon"] <= target_epsilon * (1 + 1e-3)


def test_fashion_mnist_one_epoch_on_a_subset_learns(tmp_path, capsys):
    m = _run(tmp_path, "--dataset", "fashion-mnist", "--target-epsilon", "3", "--delta", "1e-5",
             "--subset", "2000", "--epochs", "1", "--batch-size", "64", "--lr", "2", "--seed", "1",
             "--dp-seed", "1")
    assert set(m) == KEYS
    assert m["test_accuracy"] > 0.35  # chance is 0.10
    assert m["steps"] == round(2000 / 64)
    assert m["sample_rate"] == pytest.approx(64 / 2000)
    assert m["delta"] == 1e-5 and m["accountant"] == "pld"
    assert m["noise_multiplier"] > 0 and m["wall_seconds"] > 0
    _check_privacy(m, 3.0)
    out = capsys.readouterr().out
    assert "test accuracy" in out and "samples/s" in out


def test_digits_smoke_run(tmp_path):
    pytest.importorskip("sklearn", reason="--dataset digits needs scikit-learn (fastdp[data])")
    m = _run(tmp_path, "--dataset", "digits", "--target-epsilon", "3", "--delta", "1e-5", "--dp-seed", "0")
    assert set(m) == KEYS
    assert m["test_accuracy"] > 0.5
    _check_privacy(m, 3.0)


@pytest.mark.filterwarnings("ignore:batch .* released by an earlier step:UserWarning")  # runs it twice on purpose
def test_noise_and_batches_are_secret_unless_a_dp_seed_is_given(tmp_path, capsys, monkeypatch):
    """A known seed gives away the noise and the batches: by default make_private gets no seed
    (OS entropy); --dp-seed (reproducible experiments) is passed on, with a warning. --seed
    (the model's initial weights) never reaches the noise or the sampler."""
    pytest.importorskip("sklearn")
    import fastdp.train as train_module

    seen = []
    real = train_module.make_private
    monkeypatch.setattr(train_module, "make_private", lambda **kw: seen.append(kw["seed"]) or real(**kw))
    runs = [_run(tmp_path, "--dataset", "digits", "--epochs", "1", "--seed", "3", *extra)
            for extra in ([], ["--dp-seed", "5"], ["--dp-seed", "5"])]
    assert seen == [None, 5, 5]
    assert capsys.readouterr().err.count("--dp-seed makes the noise and the batches reproducible") == 2
    assert runs[1]["test_accuracy"] == runs[2]["test_accuracy"]


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("sklearn")
    plot = tmp_path / "curve.png"
    _run(tmp_path, "--dataset", "digits", "--epochs", "1", "--plot", str(plot))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        main(["train", "--dataset", "digits", "--plot", str(tmp_path / "x.png")])


def _write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_idx_files_from_data_dir(tmp_path):
    rng = np.random.default_rng(0)
    stems = {"train": (50, "train"), "test": (20, "t10k")}
    for n, stem in stems.values():
        _write_idx(tmp_path / f"{stem}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(tmp_path / f"{stem}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    data = load_dataset("fashion-mnist", data_dir=str(tmp_path), subset=30)
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10
    assert len(data.train) == 30 and len(data.test) == 20
    assert data.test.labels.tolist() == [i % 10 for i in range(20)]
    assert abs(float(data.train.inputs.mean())) < 1e-4  # standardised with the training stats
    x, y = data.train.__getitems__([3, 1])
    assert torch.equal(x[1], data.train[1][0]) and y.tolist() == [data.train[3][1], data.train[1][1]]


def test_read_idx_rejects_bad_files():
    with pytest.raises(ValueError, match="IDX"):
        read_idx(b"\x00\x00\x0d\x01" + (3).to_bytes(4, "big") + b"abc")
    with pytest.raises(ValueError, match="expected 4 bytes"):
        read_idx(b"\x00\x00\x08\x01" + (4).to_bytes(4, "big") + b"abc")


def test_missing_fashion_mnist_says_how_to_install(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))
    with pytest.raises(SystemExit, match="apt-get install dataset-fashion-mnist"):
        main(["train", "--data-dir", str(tmp_path)])


def test_batch_larger_than_dataset_is_rejected():
    pytest.importorskip("sklearn")
    with pytest.raises(ValueError, match="exceeds"):
        train(TrainConfig(dataset="digits", subset=100, batch_size=200, progress=False))


@pytest.mark.parametrize("argv, says", [
    (["--epochs", "0"], "argument --epochs: expected a positive integer, got 0"),
    (["--batch-size", "x"], "argument --batch-size: expected a positive integer, got 'x'"),
    (["--accountant", "foo"], "argument --accountant: invalid choice: 'foo'"),
    (["--delta", "2"], "argument --delta: delta must satisfy 0 < delta < 1"),
    (["--delta", "1e-320"], "argument --delta: delta=1e-320 is below"),  # a traceback from calibration (review)
    (["--momentum", "-1"], "argument --momentum: expected a number in [0, 1)"),
    (["--momentum", "1.5"], "argument --momentum: expected a number in [0, 1)"),
    (["--subset", "0"], "argument --subset: expected a positive integer"),
    (["--threads", "0"], "argument --threads: expected a positive integer"),
    (["--lr", "nan"], "argument --lr: expected a positive number"),
    (["--seed", "-1"], "argument --seed: expected an integer >= 0"),
    (["--dp-seed", "-1"], "argument --dp-seed: expected an integer >= 0"),
])
def test_bad_arguments_are_usage_errors(capsys, argv, says):
    """Bad values end in argparse's usage error naming the option, not a traceback from deep
    inside training (review)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--dataset", "digits", "--no-progress", *argv])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_a_batch_larger_than_the_subset_is_a_message_not_a_traceback():
    pytest.importorskip("sklearn")
    with pytest.raises(SystemExit, match="fastdp train: batch size 128 exceeds the 5 training examples"):
        main(["train", "--dataset", "digits", "--no-progress", "--subset", "5"])


@pytest.mark.parametrize("argv, says", [
    (["--target-epsilon", "1e-7", "--epochs", "1"], "target epsilon 1e-07 cannot be met in 1 epochs"),
    (["--data-dir", "/nonexistent"], "--data-dir is for fashion-mnist"),
    (["--subset", "100000"], "--subset 100000: expected a number of training examples from 1 to"),
    # a traceback at the first step, after loading and calibrating (checkpoint review)
    (["--max-grad-norm", "1e39"], "--max-grad-norm 1e\\+39: the noise on the torch.float32 parameters"),
])
def test_arguments_the_run_cannot_honour_are_messages(argv, says):
    """An unreachable target ended in a traceback advising an option the CLI lacks, and
    --data-dir with digits or a --subset above N were silently ignored (review)."""
    pytest.importorskip("sklearn")
    with pytest.raises(SystemExit, match=says):
        main(["train", "--dataset", "digits", "--no-progress", *argv])


@pytest.mark.parametrize("flag", ["--metrics-json", "--plot"])
def test_an_unwritable_output_path_is_refused_before_training(tmp_path, flag):
    """Found only after the whole run before (review)."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit, match=f"{flag} .*afile/out: cannot create its directory"):
        main(["train", "--dataset", "digits", "--no-progress", flag, str(tmp_path / "afile" / "out")])


@pytest.mark.parametrize("flag, name, says", [
    ("--metrics-json", "newdir/", "a directory"), ("--plot", "newdir/", "a directory"),
    ("--plot", "acc.xyz", "ending in .png")])
def test_an_output_path_the_run_cannot_write_as_asked_is_refused_before_training(tmp_path, flag, name, says):
    """A directory not yet made, or a plot format matplotlib lacks, raised a traceback after the whole
    run (checkpoint/CLI review)."""
    with pytest.raises(SystemExit, match=f"{flag} .*{says}"):
        main(["train", "--dataset", "digits", "--no-progress", flag, str(tmp_path) + "/" + name])


@pytest.mark.parametrize("damage", ["truncated", "not gzip", "corrupt stream"])
def test_a_damaged_gzip_file_is_a_message_not_a_traceback(tmp_path, damage):
    rng = np.random.default_rng(0)
    for n, stem in ((50, "train"), (20, "t10k")):
        _write_idx(tmp_path / f"{stem}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(tmp_path / f"{stem}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    images = tmp_path / "train-images-idx3-ubyte.gz"
    data = images.read_bytes()
    if damage == "corrupt stream":  # a valid header, flipped bytes in the deflate stream (zlib.error)
        data = data[:20] + bytes(b ^ 0xFF for b in data[20:60]) + data[60:]
    images.write_bytes(data[:100] if damage == "truncated" else b"not a gzip stream" if damage == "not gzip" else data)
    with pytest.raises(SystemExit, match="train-images-idx3-ubyte.gz: not a readable IDX file"):
        main(["train", "--data-dir", str(tmp_path), "--no-progress"])


def test_a_delta_not_below_one_over_n_warns():
    pytest.importorskip("sklearn")
    with pytest.warns(UserWarning, match="delta=0.05 is not below 1/N = 0.02"):
        train(TrainConfig(dataset="digits", subset=50, batch_size=10, epochs=1, delta=0.05, progress=False))


def test_the_command_prints_warnings_without_a_source_location():
    """A warning pointed at the user's line is, for the command, a line of the runpy module
    (``<frozen runpy>:88: UserWarning: ...``): the command prints it as its own."""
    pytest.importorskip("sklearn")
    argv = ["train", "--dataset", "digits", "--subset", "50", "--batch-size", "10", "--epochs", "1",
            "--delta", "0.05", "--no-progress", "--threads", "1"]
    done = subprocess.run([sys.executable, "-m", "fastdp", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "fastdp: UserWarning: delta=0.05 is not below 1/N = 0.02" in done.stderr
    assert "runpy" not in done.stderr
    plain = warnings.formatwarning
    with pytest.warns(UserWarning, match="not below 1/N"):
        main(argv)
    assert warnings.formatwarning is plain  # restored for the caller of main()


@pytest.mark.parametrize("ties", [False, True])
def test_fast_max_pool_matches_torch(ties):
    """Values and gradients of nn.MaxPool2d(2, stride=1), ties (saturated tanh) included:
    the gradient goes to each window's first maximum in raster order."""
    torch.manual_seed(int(ties))
    x = torch.randn(3, 4, 9, 7, dtype=torch.float64)
    if ties:
        x = torch.tanh(4 * x).clamp(-0.9, 0.9).round(decimals=1)  # many equal values
    x.requires_grad_()
    ours = MaxPool2x2Stride1()(x)
    ref = nn.MaxPool2d(2, stride=1)(x)
    assert torch.equal(ours, ref)
    w = torch.randn_like(ref)
    (g1,) = torch.autograd.grad((ours * w).sum(), x)
    (g2,) = torch.autograd.grad((ref * w).sum(), x)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)


def test_models_fit_their_inputs():
    for shape in ((1, 28, 28), (1, 8, 8)):
        assert build_model(shape, 10)(torch.zeros(2, *shape)).shape == (2, 10)
