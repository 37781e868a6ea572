"""Metrics: the peak FLOP/s MFU is measured against, and step timing."""

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
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda: calls.append(1) or 1.5e12)
    assert metrics.peak_flops_per_device() == 1.5e12 and metrics.peak_flops_per_device() == 1.5e12
    assert calls == [1]
    assert metrics.peak_flops_per_device(override=7.0) == 7.0


def test_step_timer_reports_compile_time_once_then_rates():
    timer = metrics.StepTimer(tokens_per_step=100, flops_per_step=1e6, peak_flops=1e9)
    started = time.perf_counter()
    timer.first_step(started)
    first = timer.report()
    assert set(first) == {"compile_time"}  # no steps timed yet after the first
    for _ in range(4):
        timer.step()
    time.sleep(0.01)
    report = timer.report()
    assert set(report) == {"step_time", "tokens_per_sec", "mfu"}
    assert report["tokens_per_sec"] == pytest.approx(100 / report["step_time"])
    assert report["mfu"] == pytest.approx(1e6 / report["step_time"] / 1e9)
    assert timer.report() == {}  # restarted by the report
