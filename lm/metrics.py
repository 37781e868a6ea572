"""Training metrics: the peak FLOP/s that MFU is measured against, and the writers of metrics.jsonl and TensorBoard."""

from __future__ import annotations

import json
import os
import platform
import time

import jax
import jax.numpy as jnp

# Dense bfloat16 peak FLOP/s per device, from the vendors' data sheets.
KNOWN_PEAKS = {
    "a100": 312e12,
    "h100": 989e12,
    "h200": 989e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,  # v5e
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,  # v6e (Trillium)
    "tpu v6e": 918e12,
}
_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "lm", "peak_flops.json")


def measure_matmul_flops(n: int = 1024, repeats: int = 5, dtype=jnp.float32) -> float:
    """Best-of-`repeats` FLOP/s of an n x n matmul on the default device."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops_per_device(override: float = 0.0) -> float:
    """The configured peak, the data-sheet peak of a known accelerator, or a CPU matmul measured once and cached."""
    if override:
        return override
    device = jax.devices()[0]
    kind = device.device_kind.lower()
    for name, peak in KNOWN_PEAKS.items():
        if name in kind:
            return peak
    key = f"{device.platform}:{kind}:{platform.processor() or platform.machine()}:{os.cpu_count()}"
    try:
        with open(_CACHE) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = measure_matmul_flops()
        try:
            os.makedirs(os.path.dirname(_CACHE), exist_ok=True)
            with open(_CACHE, "w") as f:
                json.dump(cached, f)
        except OSError:
            pass  # an unwritable home only costs a re-measurement next time
    return cached[key]


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl, and the same scalars to TensorBoard."""

    def __init__(self, run_dir: str, resume_step: int = 0, tensorboard: bool = True, config_text: str = ""):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if resume_step:
            self._truncate_after(resume_step)
        elif os.path.exists(self.path):
            os.remove(self.path)
        self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step drops the events a killed run wrote after its last checkpoint.
            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
            if config_text and not resume_step:
                self.tb.add_text("config", "```\n" + config_text + "\n```", 0)

    def _truncate_after(self, step: int) -> None:
        """Forget what a run logged after the checkpoint it resumes from, so each step appears once."""
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(("val/" if key.startswith("val_") else "train/") + key, value, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
