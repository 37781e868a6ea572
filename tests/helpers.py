"""Shared helpers for the tests: run the CLIs in a subprocess, check their one-line errors, compare runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script(name: str) -> str:
    """The checkout's NAME.py as lm prints it to run from a working directory other than the checkout."""
    return f"python {shlex.quote(os.path.join(ROOT, name + '.py'))}"


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a command a test starts: the suite's own (tests/conftest.py) and `flags`."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()


def python_path(*first: str) -> str:
    """PYTHONPATH for a child process: `first`, this checkout's lm, then the parent's own (where a GPU machine keeps
    lm's dependencies: ../shared/device/wheels.sh; a child given ROOT alone could not import grain or omegaconf)."""
    return os.pathsep.join(filter(None, [*first, ROOT, os.environ.get("PYTHONPATH")]))


def run_cli(script: str, *args: str, cwd: str | None = None, env: dict | None = None, timeout: float = 300):
    """Run `python <script> args...` from the repo root scripts, on this process's backend; return the CompletedProcess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_main(main, *args: str, capsys) -> subprocess.CompletedProcess:
    """A command's main (lm.train.main, ...) called in this process with `args`, as its script runs it, without a
    process's start-up of seconds: its exit code and output (capsys's), for assert_user_error."""
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own exit
        code = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["main", *args], code, out, err)


def assert_user_error(proc, *fragments: str) -> str:
    """A user mistake: exit code 2, no traceback, one 'error:' line that names the problem."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def skip_where_any_allocation_is_granted() -> None:
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            granted = f.read().strip() == "1"
    except OSError:  # not Linux
        granted = False
    if granted:
        pytest.skip("the kernel grants any allocation here (vm.overcommit_memory=1): terabytes would be paged in")


COMPARED = ("step", "loss", "lr", "grad_norm", "val_loss")  # what a resumed run must reproduce exactly


def losses(run_dir):
    """The run's logged history, without the timing fields that differ between processes."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k in COMPARED} for line in f]


def params(run_dir, step):
    return ocp.StandardCheckpointer().restore(os.path.join(run_dir, "checkpoints", str(step), "params"))


def assert_same_params(a, b, exact=True):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        if exact:
            np.testing.assert_array_equal(x, y)
        else:  # (two programs' rounding, which Adam's normalised update amplifies where a gradient is near 0: 1.2e-6
            # after 14 steps under XLA:CPU's older emitters, which the tests use; a step missed or run twice moves a
            # parameter by about the learning rate, 3e-3 in configs/tiny.yaml)
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


# Two differently compiled programs of one computation (a scan of steps against single steps, say): XLA:CPU rounds
# them alike to ~1e-7 here; a GPU's fusions and kernels may round each step differently, which training amplifies.
TWO_PROGRAMS_RTOL = 1e-6 if jax.default_backend() == "cpu" else 1e-4


def assert_same_losses(a, b, rtol=0.0):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=rtol, abs=0), (ra["step"], k)


def s3_client(env: dict):
    """A boto3 client of the test S3 server whose environment is `env` (tests/conftest.py's s3_server)."""
    import boto3

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])  # fmt: skip


class Bucket:
    """The test server of `scheme` (s3: conftest's s3_server, gs: its gcs_server), through a filesystem of the
    test's own: keys listed, objects read and written by key ("BUCKET/key"), to check what lm wrote there."""

    def __init__(self, scheme: str, env: dict):
        self.scheme, self.env = scheme, env
        if scheme == "s3":
            import s3fs

            self.fs = s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                                        endpoint_url=env["AWS_ENDPOINT_URL"], skip_instance_cache=True)  # fmt: skip
        else:
            import gcsfs

            self.fs = gcsfs.GCSFileSystem(
                token="anon", endpoint_url=env["STORAGE_EMULATOR_HOST"], skip_instance_cache=True
            )

    def url(self, key: str) -> str:
        return f"{self.scheme}://{key}"

    def keys(self, prefix: str) -> list[str]:
        """The keys under BUCKET/prefix, without the bucket: prefix "runs/exp/" gives ["exp/a", ...]."""
        self.fs.invalidate_cache()
        bucket, _, rest = prefix.partition("/")
        try:
            found = self.fs.find(prefix)
        except FileNotFoundError:
            return []
        return sorted(k.split("/", 1)[1] for k in found if k.split("/", 1)[1].startswith(rest))

    def put(self, key: str, body: bytes) -> None:
        self.fs.pipe_file(key, body)

    def get(self, key: str) -> bytes:
        return self.fs.cat_file(key)

    def upload(self, local: str, key: str) -> None:
        self.fs.put_file(local, key)

    def download(self, key: str, local: str) -> None:
        self.fs.get_file(key, local)


def dot_operand_dtypes(hlo: str, matrices_only: bool = False) -> list[tuple[str, ...]]:
    """The operand element types of every dot_general in a lowered (StableHLO) module; `matrices_only`: of those
    whose operands all have two axes or more (not lm.norm's matrix-vector products of row statistics)."""
    dots = re.findall(r"stablehlo.dot_general .*?: \((.*?)\) ->", hlo)
    operands = [re.findall(r"tensor<([^>]*)>", o) for o in dots]
    keep = lambda types: not matrices_only or all(t.count("x") > 1 for t in types)
    return [tuple(t.split("x")[-1] for t in types) for types in operands if keep(types)]


def tensorboard_events(run_dir) -> list:
    """The events of a run's TensorBoard files, file by file in the order they were written."""
    import struct

    from tensorboardX.proto import event_pb2

    events = []
    directory = os.path.join(run_dir, "tensorboard")
    for name in sorted(os.listdir(directory)):  # events.out.tfevents.TIME...: as they were started
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            events.append(event_pb2.Event.FromString(data[at + 12 : at + 12 + length]))  # after the length and its CRC
            at += 12 + length + 4
    return events


def tensorboard_scalars(run_dir, tag: str) -> dict[int, float]:
    """{step: value} of a scalar as TensorBoard reads a run's event files: in order, a session start at step S
    (a resumed run's) dropping the points from S on that the files before it hold."""
    points = {}
    for event in tensorboard_events(run_dir):
        if event.HasField("session_log") and event.session_log.status == event.session_log.START:
            points = {step: value for step, value in points.items() if step < event.step}
        points.update({event.step: v.simple_value for v in event.summary.value if v.tag == tag})
    return points


def load_tokens(data_dir: str, split: str, meta: dict | None = None) -> np.ndarray:
    """The token ids of a prepared split, in order, read into memory (training reads windows from the shards)."""
    from lm import storage
    from lm.data.meta import load_meta

    meta = meta or load_meta(data_dir)
    ranges = np.array(meta["splits"][split]["ranges"], np.int64).reshape(-1, 3)
    size = np.dtype(meta["dtype"]).itemsize
    paths = [os.path.join(data_dir, meta["shards"][i]["name"]) for i in ranges[:, 0]]
    read = storage.read_ranges(paths, ranges[:, 1] * size, ranges[:, 2] * size)
    parts = [np.frombuffer(p, meta["dtype"]) for p in read]
    return np.concatenate(parts) if parts else np.zeros(0, meta["dtype"])
