"""Metrics: the peak FLOP/s MFU is measured against, and step timing."""

import statistics
import time
from types import SimpleNamespace

import jax
import pytest

from lm import metrics


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),  # SXM
        ("NVIDIA H100 PCIe", 756e12),  # contains "h100" too, yet peaks lower
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5", 459e12),
    ],
)
def test_known_peaks_match_the_exact_device_kind(monkeypatch, kind, peak):
    monkeypatch.setattr(jax, "devices", lambda: [SimpleNamespace(device_kind=kind, platform="gpu")])
    assert metrics.peak_flops_per_device() == peak


def test_unknown_device_is_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setattr(jax, "devices", lambda: [SimpleNamespace(device_kind="NVIDIA H100-like card", platform="gpu")])
    monkeypatch.setattr(metrics, "_CACHE", str(tmp_path / "peak.json"))
    calls = []
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda dtype: calls.append(1) or 1.5e12)
    assert metrics.peak_flops_per_device() == 1.5e12 and metrics.peak_flops_per_device() == 1.5e12
    assert calls == [1]
    assert metrics.peak_flops_per_device(override=7.0) == 7.0
    # Under another JAX (other XLA matmul kernels), measured again: the other's peak made MFU 20% off.
    monkeypatch.setattr(jax, "__version__", "0.0.1")
    assert metrics.peak_flops_per_device() == 1.5e12 and calls == [1, 1]


def test_an_unknown_devices_peak_is_measured_in_the_models_dtype(monkeypatch, tmp_path):
    """A bfloat16 run on a GPU missing from KNOWN_PEAKS (a B200, an L4) measured its peak with float32 matmuls,
    which a GPU runs as TF32 at half its bfloat16 rate: MFU twice too high, past 100%, in every run."""
    monkeypatch.setattr(jax, "devices", lambda: [SimpleNamespace(device_kind="NVIDIA B200", platform="gpu")])
    monkeypatch.setattr(metrics, "_CACHE", str(tmp_path / "peak.json"))
    rates = {"float32": 1e15, "bfloat16": 2e15}
    measured = []
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda dtype: measured.append(dtype.name) or rates[dtype.name])
    assert metrics.peak_flops_per_device(dtype="bfloat16") == 2e15
    assert metrics.peak_flops_per_device() == 1e15  # (float32, cached apart)
    assert metrics.peak_flops_per_device(dtype="bfloat16") == 2e15 and measured == ["bfloat16", "float32"]
    metrics.peak_below_rate(dtype="bfloat16")  # an MFU above 100% drops the bfloat16 peak alone
    assert list(metrics.read_json(str(tmp_path / "peak.json")).values()) == [1e15]


def test_step_timer_reports_compile_time_once_then_rates():
    timer = metrics.StepTimer(tokens_per_step=100, flops_per_step=1e6, peak_flops=1e9)
    timer.first_step(0.25)
    first = timer.report()
    assert first == {"compile_time": 0.25}  # no steps timed yet after the first
    for _ in range(4):
        timer.step()
    time.sleep(0.01)
    report = timer.report()
    assert set(report) == {"step_time", "tokens_per_sec", "mfu"}
    assert report["tokens_per_sec"] == pytest.approx(100 / report["step_time"])
    assert report["mfu"] == pytest.approx(1e6 / report["step_time"] / 1e9)
    assert timer.report() == report  # no step since: a later row of the same call, which the report timed
    timer.step(2)
    time.sleep(0.02)
    timer.compiled(0.5)  # a call of a new length: its compilation is neither step time nor lost
    again = timer.report()
    assert again["compile_time"] == 0.5 and 0 < again["step_time"] < 0.02  # (0.5 s over 2 steps: ~0.26 s each)


def test_every_logged_row_of_a_call_has_its_speed_and_a_new_call_length_compiles_outside_step_time(tiny_args):
    """(With several logged steps a call, only the first row of each call had tokens_per_sec, mfu and step_time;
    a call of a new length, here before an evaluation, counted its compilation as its steps' time, and then the
    wait for the call before it, whose rows read 1000x too fast, with a false MFU warning; then its first run,
    30x slower than later runs of that length.)"""
    from lm.train import train
    from tests.test_train import read_metrics, tiny_cfg

    cfg = tiny_cfg(tiny_args, "train.steps=14", "train.log_every=1", "train.steps_per_call=4", "train.eval_every=10",
                   "train.ckpt_every=0", "model.n_embd=128", "data.block_size=64")
    rows = [r for r in read_metrics(train(cfg)) if "loss" in r]  # calls: 1-4 (compiles), 5-8, 9-10, 11-12, 13-14
    assert [r["step"] for r in rows] == list(range(1, 15))
    compiling = (1, 2, 3, 4, 9, 10)  # the first call of each length: compiled, then run once, and waited for
    assert [r["step"] for r in rows if "compile_time" in r] == [1, 9]
    for r in rows:
        assert ({"tokens_per_sec", "mfu", "step_time"} <= set(r)) == (r["step"] not in compiling), r
    for call in ((5, 6, 7, 8), (11, 12), (13, 14)):
        assert len({rows[step - 1]["step_time"] for step in call}) == 1
    times = [r["step_time"] for r in rows if "step_time" in r]
    assert max(times) < rows[8]["compile_time"] / 5 and max(times) < 10 * min(times), times


# 1:2 (a profile of the first steps): about 20 s, in the slow tier; .ci/run runs it after the default suite
@pytest.mark.parametrize("window", [pytest.param("1:2", marks=pytest.mark.slow), "5:2"])
def test_writing_a_profiles_trace_is_neither_step_time_nor_compile_time(tiny_args, monkeypatch, capsys, window):
    """(The call that ended a profile was waited for before the call before it was fetched: that one's rows held
    both calls' time and the profiled call's almost none, read 50x too fast with a false MFU warning; a profile of
    the first steps logged the trace's writing as compile_time, 33.7 s against 1.6.) Writing the trace here
    takes 1000 s of the clock the timer reads."""
    from lm.train import train
    from tests.test_train import read_metrics, tiny_cfg

    clock, stop_trace, offset = time.perf_counter, jax.profiler.stop_trace, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + offset[0])
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: (offset.__setitem__(0, offset[0] + 1000), stop_trace()))
    cfg = tiny_cfg(tiny_args, "train.steps=10", "train.log_every=1", "train.steps_per_call=2", "train.eval_every=0",
                   "train.ckpt_every=0", f"train.profile_steps={window}")
    rows = [r for r in read_metrics(train(cfg)) if "loss" in r]
    assert offset[0] == 1000  # (the trace was written)
    assert [r["step"] for r in rows if "compile_time" in r] == [1] and rows[0]["compile_time"] < 500
    times = [r["step_time"] for r in rows if "step_time" in r]
    # Against the median: two honest calls of a tiny model differed 10.7x on a loaded 2-core machine, while the
    # profiled call read 50x too fast (and the 1000 s of the trace's writing would be 1000 s).
    typical = statistics.median(times)
    assert len(times) == 8 and typical / 10 < min(times) <= max(times) < 10 * typical, times
    assert "above 100%" not in capsys.readouterr().err


def test_an_mfu_above_100_percent_says_the_peak_is_low_once_and_a_measured_one_is_measured_again(
    monkeypatch, tmp_path, capsys
):
    """(A peak measured while the machine was busy stayed in the cache for good: MFU 194% in every run after.)"""
    monkeypatch.setattr(jax, "devices", lambda: [SimpleNamespace(device_kind="cpu", platform="cpu")])
    monkeypatch.setattr(metrics, "_CACHE", str(tmp_path / "peak.json"))
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda dtype: 1e9)
    peak = metrics.peak_flops_per_device()
    assert (tmp_path / "peak.json").exists()
    timer = metrics.StepTimer(100, 1e9, peak, low_peak=metrics.peak_below_rate)
    timer.step(10)  # 10 GFLOP in far less than the 10 s a 1 GFLOP/s peak allows
    assert timer.report()["mfu"] > 1
    err = capsys.readouterr().err
    assert err.startswith("warning: MFU ") and "is above 100%: the peak it is measured against, 1 GFLOP/s" in err
    assert "measured again when the next run starts" in err
    assert metrics.read_json(str(tmp_path / "peak.json")) == {}  # so the next run measures it
    timer.step(10)
    timer.report()
    assert capsys.readouterr().err == ""  # once
    timer = metrics.StepTimer(100, 1e9, 1e9, low_peak=lambda: metrics.peak_below_rate(1e9))
    timer.step(10)
    timer.report()
    assert "train.peak_flops is set below what this run reaches: raise it" in capsys.readouterr().err


def test_the_mfu_warning_starts_its_own_line_under_a_progress_bar(capsys):
    """(A quick start on a busy 2-core machine printed `  8%|▊  | 121/1500 [..., loss=4.8633]warning: MFU 132% ...`:
    the warning glued to the end of the bar's line.)"""
    import sys

    from tqdm import tqdm

    bar = tqdm(total=100, file=sys.stderr, disable=False)
    bar.update(5)
    timer = metrics.StepTimer(100, 1e9, 1e9, low_peak=lambda: metrics.peak_below_rate(1e9))
    timer.step(10)
    timer.report()
    bar.close()
    err = capsys.readouterr().err
    assert "warning: MFU " in err
    assert err[err.index("warning: MFU ") - 1] in "\r\n"  # the bar's line cleared first


def test_tensorboard_writer_does_not_import_torch(tmp_path):
    """tensorboardX's writer imports torch where it is installed: seconds of every run's start-up, for nothing the
    event file needs. A stand-in torch on the path says whether it was imported; a later `import torch` still works."""
    import os
    import subprocess
    import sys

    (tmp_path / "torch.py").write_text("Tensor = object\n")
    code = (
        "import sys; from lm import metrics; metrics._TensorBoard(sys.argv[1], 0, 'a: 1'); "
        "print('torch' in sys.modules); import torch; print(torch.Tensor is object)"
    )
    checkout = os.path.dirname(os.path.dirname(metrics.__file__))
    path = os.pathsep.join([str(tmp_path), checkout, os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": path}, check=True).stdout.split()  # fmt: skip
    assert out == ["False", "True"]
