"""Faults a real cluster and real users cause: kills at random moments, SIGTERM mid-evaluation and
mid-save, a full disk, a vanished run directory, checkpoints from elsewhere, data changed under a run,
and a loss that blows up. Each must end in an exact resume or one clear error, never lost work."""

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import (
    ROOT,
    assert_same_losses,
    assert_same_params,
    assert_user_error,
    losses,
    params,
    run_cli,
)

from lm import config as config_lib
from lm.train import train

# A short run whose evaluation (100 batches) is long enough to be interrupted on purpose.
SHORT = ["train.steps=200", "train.ckpt_every=50", "train.eval_every=50", "train.eval_batches=100", "train.log_every=1"]
# A long run with frequent saves, for kills at random moments.
LONG = ["train.steps=3000", "train.ckpt_every=25", "train.eval_every=250", "train.log_every=1"]


def _args(data_cache, run_dir, *more):
    return [f"data.cache_dir={data_cache}", "logging.progress=false", "train.peak_flops=1e12", f"run.dir={run_dir}", *more]


def _cmd(data_cache, run_dir, *more):
    return [sys.executable, os.path.join(ROOT, "train.py"), "tiny", *_args(data_cache, run_dir, *more)]


def _env():
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _start(cmd, cwd):
    return subprocess.Popen(
        cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
    )


def _saving(ckpt_dir) -> bool:
    """Whether orbax is writing a checkpoint right now (its temporary directory exists)."""
    try:
        return any(".orbax-checkpoint-tmp" in name for name in os.listdir(ckpt_dir))
    except FileNotFoundError:
        return False


def _wait_until(condition, proc, timeout=180.0, poll=0.001) -> bool:
    """Poll `condition` until it holds (True) or the process ends first (False)."""
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            return False
        assert time.time() < deadline, "timed out waiting on the training process"
        time.sleep(poll)
    return True


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    """The uninterrupted SHORT run that interrupted ones must reproduce bit for bit."""
    tmp = tmp_path_factory.mktemp("reference")
    _run(_cmd(data_cache, tmp / "run", *SHORT), tmp)
    return tmp / "run"


def assert_reproduces(reference_dir, run_dir, last_step):
    assert_same_losses(losses(reference_dir), losses(run_dir))
    assert_same_params(params(reference_dir, last_step), params(run_dir, last_step))


# ------------------------------------------------------------------------------------------ kills


def _logged_step(run_dir) -> int:
    """The last step in the run's metrics.jsonl (0 before any)."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 4096, 0))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        if line.startswith('{"step": ') and line.endswith("}"):
            return int(line.split(",")[0].split(": ")[1])
    return 0


class _SaveCounter:
    """Counts checkpoint writes as they start (a temporary directory appearing), polled often."""

    def __init__(self, ckpt_dir, target: int):
        self.ckpt_dir, self.target, self.seen, self.was_saving = ckpt_dir, target, 0, False

    def __call__(self) -> bool:
        saving = _saving(self.ckpt_dir)
        self.seen += saving and not self.was_saving
        self.was_saving = saving
        return self.seen >= self.target


@pytest.mark.slow
def test_ten_random_kills_resume_bit_exact(tmp_path, data_cache):
    """SIGKILL at 10 random moments: during start-up, during training a random number of steps after
    the resume point, and during the n-th checkpoint write (at least three times); each time the same
    command runs again. The result equals an uninterrupted run bit for bit."""
    whole = tmp_path / "whole"
    _run(_cmd(data_cache, whole, *LONG), tmp_path)
    run_dir = tmp_path / "run"
    ckpt_dir = run_dir / "checkpoints"
    cmd = _cmd(data_cache, run_dir, *LONG)
    rng = random.Random(1234)
    moments = ["startup"] + ["training"] * 5 + ["save"] * 4
    rng.shuffle(moments)
    mid_save = 0
    for moment in moments:
        proc = _start(cmd, tmp_path)
        if moment == "startup":
            alive = not _exited_within(proc, rng.uniform(0.2, 2.0))
        elif moment == "training":
            target = _logged_step(run_dir) + rng.randint(5, 150)
            alive = _wait_until(lambda: _logged_step(run_dir) >= target, proc)
        else:
            alive = _wait_until(_SaveCounter(ckpt_dir, rng.randint(1, 3)), proc)
        assert alive, f"the run ended before the {moment} kill: {proc.communicate()[1][-2000:]}"
        proc.kill()
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        mid_save += moment == "save" and _saving(ckpt_dir)
    assert mid_save >= 1, "no kill landed inside a checkpoint write"
    done = _run(cmd, tmp_path)
    assert "resumed" in done.stdout
    assert_same_losses(losses(whole), losses(run_dir))
    assert_same_params(params(whole, 3000), params(run_dir, 3000))
    assert not _saving(ckpt_dir)  # interrupted writes were cleaned up


def _exited_within(proc, seconds) -> bool:
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


# --------------------------------------------------------------------------------------- SIGTERM


def _sigterm_when(cmd, cwd, condition):
    proc = _start(cmd, cwd)
    assert _wait_until(condition, proc), proc.communicate()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err
    assert "SIGTERM: stopped after step" in out, out[-2000:]
    return int(out.split("SIGTERM: stopped after step ")[1].split()[0]), out


@pytest.mark.slow
def test_sigterm_during_evaluation(tmp_path, data_cache, reference):
    run_dir = tmp_path / "run"
    cmd = _cmd(data_cache, run_dir, *SHORT)
    proc = _start(cmd, tmp_path)
    # The loop logs step 100's loss, then evaluates 100 batches: the signal lands inside that evaluation.
    for line in proc.stdout:
        if line.startswith("step 100: loss"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "step 100: val_loss" in out  # the evaluation finished
    assert "SIGTERM: stopped after step 100" in out
    assert os.path.isdir(run_dir / "checkpoints" / "100") and not _saving(run_dir / "checkpoints")
    _run(cmd, tmp_path)
    assert_reproduces(reference, run_dir, 200)


@pytest.mark.slow
def test_sigterm_during_a_save(tmp_path, data_cache, reference):
    run_dir = tmp_path / "run"
    cmd = _cmd(data_cache, run_dir, *SHORT)
    stopped, _ = _sigterm_when(cmd, tmp_path, lambda: _saving(run_dir / "checkpoints"))
    assert stopped >= 50
    assert os.path.isdir(run_dir / "checkpoints" / str(stopped)) and not _saving(run_dir / "checkpoints")
    done = _run(cmd, tmp_path)
    assert f"from step {stopped}" in done.stdout
    assert_reproduces(reference, run_dir, 200)


# ------------------------------------------------------------------------------------ disk errors


def _pause_between_saves(proc, run_dir, every: int, last: int) -> int:
    """Stop the run (SIGSTOP) at a moment between two saves and return N: checkpoint N is complete, nothing is
    being written, and the run is well before step N + every <= last, so the next save it starts is N + every.

    Deleting the directory or filling the disk while a save is being written makes what happens depend on which
    write meets the damage first; both tests below used to do that (when a save took about as long as the steps
    between two, checkpoint 50 appeared just as the save of 100 began), and failed now and then."""
    ckpts = run_dir / "checkpoints"
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None, ("the run ended before a pause between two saves", proc.communicate())
        assert time.time() < deadline, "timed out waiting for a moment between two saves"
        proc.send_signal(signal.SIGSTOP)
        try:
            steps = sorted(int(d) for d in os.listdir(ckpts) if d.isdigit())
        except FileNotFoundError:
            steps = []
        logged = _logged_step(run_dir)  # a call's line is written after the next call starts: step <= logged + 1
        if steps and not _saving(ckpts) and steps[-1] < logged <= steps[-1] + every - 5 and steps[-1] + every <= last:
            return steps[-1]
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.005)


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A 50 MB tmpfs, made smaller by the test, or a skip where mounting is not allowed."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    try:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=50m", "tmpfs", str(mount)], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_full_disk_stops_with_a_clear_error_and_keeps_checkpoints(tmp_path, data_cache, reference, tiny_filesystem):
    # The disk is filled between two saves, to half a checkpoint's size more than the run uses: the next save
    # cannot fit and the space check before it says so; the logs the run writes until then (some 30 KB) still
    # fit. A fixed small disk (1.8 MB) was filled by whichever write came first, a save's included, depending on
    # how far the previous save had got; its size held for one version of orbax only.
    run_dir = tiny_filesystem / "run"
    cmd = _cmd(data_cache, run_dir, *SHORT)
    proc = _start(cmd, tmp_path)
    try:
        done = _pause_between_saves(proc, run_dir, every=50, last=200)
        kept = ", ".join(sorted((d for d in os.listdir(run_dir / "checkpoints") if d.isdigit()), key=int))
        size = sum(f.stat().st_size for f in (run_dir / "checkpoints" / str(done)).rglob("*") if f.is_file())
        full = shutil.disk_usage(tiny_filesystem).used + size // 2
        subprocess.run(["mount", "-o", f"remount,size={full}", str(tiny_filesystem)], check=True)
    finally:
        proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    line = assert_user_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert f"not enough disk space for checkpoint {done + 50}" in line, line
    assert f"complete checkpoints: {kept}. Free space (the run deletes its oldest only once a new one is written" in line
    # With room again, the same command resumes from the last checkpoint as if nothing happened.
    subprocess.run(["mount", "-o", "remount,size=50m", str(tiny_filesystem)], check=True)
    done_again = _run(cmd, tmp_path)
    assert f"from step {done}" in done_again.stdout
    assert_reproduces(reference, run_dir, 200)


# slow: about 22 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_resuming_onto_a_full_disk_is_one_line_and_loses_nothing(tmp_path, data_cache, tiny_filesystem):
    """The run-directory check before a resume writes an empty file, which a full disk still takes: the config.yaml
    and metrics writes after it were OSError tracebacks. One line now, and with room again the run resumes."""
    run_dir = tiny_filesystem / "run"
    cmd = _cmd(data_cache, run_dir, "train.steps=20", "train.ckpt_every=10", "train.eval_every=0")
    _run(cmd, tmp_path)
    config = (run_dir / "config.yaml").read_text()
    with open(tiny_filesystem / "filler", "wb", buffering=0) as f:  # the disk full, to its last block
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
    longer = [*cmd[:-3], "train.steps=30", "train.ckpt_every=10", "train.eval_every=0"]
    proc = subprocess.run(longer, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    line = assert_user_error(proc, "No space left on device", "free space (or fix the directory), then run the same command")
    assert line.startswith("error: cannot write "), line
    assert (run_dir / "config.yaml").read_text() == config  # nothing lost
    (tiny_filesystem / "filler").unlink()
    assert "from step 20" in _run(longer, tmp_path).stdout


def _fill(disk, leave: int = 0):
    """Fill `disk` to its last block, then give back `leave` bytes (a file's worth, which the test then writes)."""
    with open(disk / "filler", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        f.truncate(max(f.tell() - leave, 0))


# slow: about 17 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_prepare_export_and_sample_on_a_full_disk_are_one_line_each(tmp_path, tiny_run, tiny_filesystem):
    """Each was a traceback (numpy's "N requested and M written", safetensors' IoError, print's OSError), and an export
    cut short left a directory whose merges.txt was empty, which the next export refused as not empty."""
    from lm.config import BUNDLED_CORPUS

    disk = tiny_filesystem
    _fill(disk, leave=300 << 10)  # less than the corpus's 2.2 MB of tokens
    prepare = ["-m", "lm.data", "prepare", BUNDLED_CORPUS, "--tokenizer", "bytes", "--out", str(disk / "data"), "--quiet"]
    proc = subprocess.run([sys.executable, *prepare], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert_user_error(proc, f"cannot write prepared data to {disk / 'data'}: No space left on device; free space")
    export = ["-m", "lm.export", tiny_run, str(disk / "hf")]
    _fill(disk, leave=40 << 10)  # less than the model's 160 KB of weights
    proc = subprocess.run([sys.executable, *export], cwd=ROOT, capture_output=True, text=True, timeout=300)
    _fill(disk)
    assert_user_error(proc, f"cannot write {disk / 'hf'}: No space left on device; free space (or give another")
    # no export, not even half of one; nor the prepare's directory, which held no shard (only its locks)
    assert sorted(os.listdir(disk)) == ["filler"]
    with open(disk / "sample.txt", "w") as out:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), tiny_run, "--prompt", "the ",
                               "--max-new-tokens", "20", "--quiet"], stdout=out, stderr=subprocess.PIPE, text=True,
                              timeout=300)  # fmt: skip
    assert_user_error(proc, "cannot write the output: No space left on device; free space (or write elsewhere)")
    (disk / "filler").unlink()  # with room again, the same commands finish (prepare from where it stopped)
    for command in (prepare, export):
        subprocess.run([sys.executable, *command], cwd=ROOT, check=True, capture_output=True, timeout=300)
    assert os.path.getsize(disk / "data" / "tokens-00000.bin") == 2 * (os.path.getsize(BUNDLED_CORPUS) + 1)
    assert "model.safetensors" in os.listdir(disk / "hf")


@pytest.mark.slow
def test_a_checkpoint_directory_made_read_only_mid_run_is_one_line_at_once(tmp_path, data_cache, reference):
    """orbax waited 300 s for the step directory it could not make, then failed naming a timeout."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    cmd = _cmd(data_cache, run_dir, *SHORT)
    proc = _start(cmd, tmp_path)
    bound = False
    try:
        done = _pause_between_saves(proc, run_dir, every=50, last=200)
        for mount in (["--bind", str(ckpts), str(ckpts)], ["-o", "remount,bind,ro", str(ckpts)]):
            made = subprocess.run(["mount", *mount], capture_output=True)
            bound = bound or made.returncode == 0
            if made.returncode != 0:
                proc.kill()
                pytest.skip("cannot bind-mount here (needs root)")
    finally:
        proc.send_signal(signal.SIGCONT)
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            if bound:
                subprocess.run(["umount", "-l", str(ckpts)], check=False)
    line = assert_user_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert f"checkpoint directory {ckpts} cannot be written (Read-only file system), so checkpoint {done + 50}" in line
    assert "Make it writable (was it remounted read-only?), then resume with the same command" in line
    assert "never awaited" not in err
    assert f"from step {done}" in _run(cmd, tmp_path).stdout
    assert_reproduces(reference, run_dir, 200)


# slow: about 9 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_run_directory_vanishing_mid_run_is_a_clear_error(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    proc = _start(_cmd(data_cache, run_dir, *SHORT), tmp_path)
    try:
        done = _pause_between_saves(proc, run_dir, every=50, last=200)
        shutil.rmtree(run_dir)  # the run is stopped: nothing is written meanwhile
    finally:
        proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    proc_result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert_user_error(proc_result, "is gone", f"checkpoint {done + 50} cannot be written")


# ---------------------------------------------------------------------------------- checkpoints


def _train_steps(data_cache, run_dir, stop_after, *more):
    cfg = config_lib.load("tiny", _args(data_cache, run_dir, "train.steps=40", "train.ckpt_every=10", *more))
    train(cfg, stop_after=stop_after)
    return cfg


# slow: about 8 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_step_directory_from_another_model_is_refused(tmp_path, data_cache):
    _train_steps(data_cache, tmp_path / "run", 20)
    _train_steps(data_cache, tmp_path / "other", 10, "model.n_embd=48")
    ckpts = tmp_path / "run" / "checkpoints"
    shutil.copytree(tmp_path / "other" / "checkpoints" / "10", ckpts / "30")
    before = sorted(os.listdir(ckpts))
    proc = run_cli("train.py", "tiny", *_args(data_cache, tmp_path / "run", "train.steps=40", "train.ckpt_every=10"))
    assert_user_error(proc, f"checkpoint {ckpts}/30 was trained with a different model", "n_embd")
    assert sorted(os.listdir(ckpts)) == before  # nothing moved or deleted


# slow: about 16 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_parameters_of_another_shape_are_skipped_never_loaded(tmp_path, data_cache):
    """A step whose config matches but whose arrays do not (files copied over) is skipped, not loaded."""
    _train_steps(data_cache, tmp_path / "run", 30)
    _train_steps(data_cache, tmp_path / "other", 10, "model.n_embd=48")
    step30 = tmp_path / "run" / "checkpoints" / "30"
    for item in ("params", "train"):
        shutil.rmtree(step30 / item)
        shutil.copytree(tmp_path / "other" / "checkpoints" / "10" / item, step30 / item)
    proc = run_cli("train.py", "tiny", *_args(data_cache, tmp_path / "run", "train.steps=40", "train.ckpt_every=10"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "/30 cannot be restored" in proc.stderr
    assert "from step 20" in proc.stdout


# ----------------------------------------------------------------------------------------- data


def test_prepared_tokens_modified_in_place_are_detected(tmp_path, data_cache):
    from lm.data.prepare import prepare

    out = tmp_path / "prepared"
    prepare([os.path.join(ROOT, "lm", "assets", "tinyshakespeare.txt")], "bytes", str(out), progress=False)
    with open(out / "tokens-00000.bin", "r+b") as f:  # same size, other tokens
        f.seek(1000)
        f.write(b"\x41\x00" * 8)
    proc = run_cli("train.py", "tiny", *_args(data_cache, tmp_path / "run", f"data.path={out}"))
    assert_user_error(proc, "tokens-00000.bin does not match the checksum", "prepare it again")


# slow: about 11 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_resume_on_changed_data_is_refused(tmp_path, data_cache):
    corpus = tmp_path / "corpus.txt"
    with open(os.path.join(ROOT, "lm", "assets", "tinyshakespeare.txt")) as f:
        corpus.write_text(f.read()[:200_000])
    more = [f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}"]
    _train_steps(data_cache, tmp_path / "run", 10, *more)
    corpus.write_text(corpus.read_text().replace("the", "THE"))  # same size, different tokens
    proc = run_cli("train.py", "tiny", *_args(data_cache, tmp_path / "run", "train.steps=40", "train.ckpt_every=10", *more))
    assert_user_error(proc, "training data changed since checkpoint", "/checkpoints/10", "init_from=")


# slow: about 12 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_resume_with_an_optimizer_of_another_shape_is_refused_not_skipped(tmp_path, data_cache):
    _train_steps(data_cache, tmp_path / "run", 10)
    proc = run_cli(
        "train.py", "tiny", *_args(data_cache, tmp_path / "run", "train.steps=40", "train.ckpt_every=10", "optim.grad_clip=0")
    )
    assert_user_error(proc, "/checkpoints/10 was trained with other settings", "optim.grad_clip 1.0 vs 0")
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["10"]  # not renamed as unreadable


# ------------------------------------------------------------------------------------------ NaN


# slow: about 10 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_nan_mid_run_names_the_step_and_the_last_good_checkpoint(tmp_path, data_cache):
    _train_steps(data_cache, tmp_path / "run", 10)
    # Resumed with an absurd learning rate, the loss becomes non-finite a few steps later.
    proc = run_cli(
        "train.py",
        "tiny",
        *_args(data_cache, tmp_path / "run", "train.steps=40", "train.ckpt_every=10", "optim.lr=1e30"),
    )
    line = assert_user_error(proc, "became", f"last good checkpoint: {tmp_path / 'run' / 'checkpoints'}/10")
    step = int(line.split(" at step ")[1].split(";")[0])
    assert 10 < step <= 20  # caught before the step-20 checkpoint could save non-finite parameters
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["10"]
