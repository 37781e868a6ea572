"""Checkpoints: exact resume (in and out of process), preemption, mesh changes, interrupted saves, errors."""

import contextlib
import json
import logging
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import orbax.checkpoint as ocp
import pytest
from helpers import (
    ROOT,
    assert_same_losses,
    assert_same_params,
    assert_user_error,
    losses,
    params,
    python_path,
    run_cli,
    script,
    tensorboard_scalars,
    xla_flags,
)

from lm import checkpoint as ckpt_lib
from lm import config as config_lib
from lm import pretrained
from lm.config import BUNDLED_CORPUS, SampleConfig
from lm.errors import UserError
from lm.scripts import command_line
from lm.metrics import read_metrics
from lm.sampling import generate
from lm.tokenizer import get_tokenizer
from lm.train import train


def args_for(tiny_args, run_dir, *more):
    return [a for a in tiny_args if not a.startswith("run.dir=")] + [f"run.dir={run_dir}", *more]


RESUME = ["train.steps=40", "train.ckpt_every=10", "train.eval_every=10", "train.log_every=1"]


def test_in_process_resume_is_exact(tmp_path, tiny_args):
    whole = train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "whole", *RESUME)))
    cfg = config_lib.load("tiny", args_for(tiny_args, tmp_path / "resumed", *RESUME))
    train(cfg, stop_after=25)  # "killed" after step 25: steps 21-25 are lost with it
    assert sorted(os.listdir(tmp_path / "resumed" / "checkpoints"))[-1] == "20"
    resumed = train(cfg)
    assert_same_losses(losses(whole), losses(resumed))
    assert len(losses(whole)) == 40 + 4  # one row per step, plus four evaluations
    assert_same_params(params(whole, 40), params(resumed, 40))


def test_a_resume_or_a_fine_tune_holds_no_random_state_beside_its_own(tmp_path, tiny_args, monkeypatch):
    """A resume restored the train state beside a randomly initialised one, and a full fine-tune initialised random
    weights beside those it loaded: twice the state's device memory at every resume (a run whose state fills more
    than half of its devices could not resume), and an initialisation compiled for nothing."""
    import gc

    import jax

    from lm.steps import Trainer

    base = train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", "train.steps=2", "train.eval_every=0")))
    seen, restore, create = {}, ckpt_lib.Checkpoints.restore_newest, Trainer.create.__func__
    gc.collect()
    before = {id(x) for x in jax.live_arrays()}
    held = lambda: sum(x.nbytes for x in jax.live_arrays() if id(x) not in before)  # (bytes made since `before`)
    state_bytes = lambda state: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))

    def restoring(self, steps, abstract, *args):
        seen["at restore"], seen["state"] = held(), state_bytes(abstract)
        return restore(self, steps, abstract, *args)

    def creating(cls, *args, **kwargs):
        trainer, state = create(cls, *args, **kwargs)
        seen["at create"], seen["state"] = held(), state_bytes(state)
        return trainer, state

    monkeypatch.setattr(ckpt_lib.Checkpoints, "restore_newest", restoring)
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", "train.steps=3", "train.eval_every=0")))
    assert seen["at restore"] < 0.1 * seen["state"]  # (a random state of the same size was there)
    monkeypatch.setattr(Trainer, "create", classmethod(creating))
    gc.collect()
    before = {id(x) for x in jax.live_arrays()}
    ft = args_for(tiny_args, tmp_path / "ft", f"init_from={base}", "train.steps=1", "train.eval_every=0")
    train(config_lib.load("tiny", ft))
    assert seen["at create"] < 1.1 * seen["state"]  # its weights and their optimizer state (4/3 with random ones)


def test_checkpoints_without_a_validation_loss_log_no_warning(tmp_path, tiny_args, caplog):
    """train(cfg) from Python with train.eval_every=0 printed orbax's `WARNING:absl:Requested `tracked_metric`; did
    not provide metrics.` at every checkpoint (the commands quiet absl's log; a notebook does not)."""
    caplog.set_level(logging.WARNING, logger="absl")
    args = args_for(tiny_args, tmp_path / "run", "train.steps=3", "train.ckpt_every=1", "train.eval_every=0")
    train(config_lib.load("tiny", args))
    assert "3" in os.listdir(tmp_path / "run" / "checkpoints")
    assert not [r for r in caplog.records if "tracked_metric" in r.getMessage()]
    assert not logging.getLogger("absl").filters  # (the filter held for the saves only)


def test_a_checkpoint_resumes_under_another_number_of_processes(tmp_path, tiny_args):
    """A job of N processes writes the data stream's state once per process, as data/process_I-of-N.json (the same
    state in each). grain restores only this process's file of a job of this size: a checkpoint of 2 processes,
    resumed by 1, was set aside as damaged, and the same command again started the run over. Here step 20's files
    are as a 2-process job leaves them, its data state no longer at step 0's batch."""
    whole = train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "whole", *RESUME)))
    cfg = config_lib.load("tiny", args_for(tiny_args, tmp_path / "resumed", *RESUME))
    train(cfg, stop_after=25)
    data = tmp_path / "resumed" / "checkpoints" / "20" / "data"
    own = data / "process_0-of-1.json"
    assert json.loads(own.read_text()) == {"next_index": 20}
    for i in range(2):
        shutil.copy(own, data / f"process_{i}-of-2.json")
    own.unlink()
    resumed = train(cfg)
    assert not [name for name in os.listdir(tmp_path / "resumed" / "checkpoints") if "unreadable" in name]
    assert_same_losses(losses(whole), losses(resumed))


def _overfitting_run(tmp_path, tiny_args) -> list[str]:
    """Overrides for a run whose best checkpoint is not its last: it learns the cycle abc and is scored on acb,
    which it first gets better at (the letters) and then worse (the order)."""
    (tmp_path / "train.txt").write_text("abc" * 3000)
    (tmp_path / "val.txt").write_text("acb" * 1000)
    return args_for(
        tiny_args, tmp_path / "run", f"data.path={tmp_path / 'train.txt'}", f"data.val_path={tmp_path / 'val.txt'}",
        "train.steps=80", "train.eval_every=5", "train.ckpt_every=5", "train.keep=1",
    )


def test_a_checkpoint_of_first_format_data_says_why_it_cannot_be_compared():
    """Data prepared before 2026-11-23 (train.bin, val.bin) is prepared again as shards: the resume was refused as
    "the training data changed" though the tokens were the same; it now says what happened. A first-format
    directory given as it is still compares file by file."""
    stored = {"checksums": {"train.bin": "a", "val.bin": "b"}, "tokens": {"train": 90, "val": 10}}
    shards = {"checksums": {"tokens-00000.bin": "c"}, "tokens": {"train": 90, "val": 10}}
    none = lambda name, digest: False  # (no file has the stored digest in another form)
    with pytest.raises(UserError, match=r"was trained on data in lm's first prepared format \(train.bin and val.bin"):
        ckpt_lib.check_dataset("ckpts", 20, stored, shards, none)
    ckpt_lib.check_dataset("ckpts", 20, stored, stored, none)
    with pytest.raises(UserError, match=r"the training data changed since checkpoint ckpts/20 was written \(val.bin"):
        ckpt_lib.check_dataset("ckpts", 20, stored, {**stored, "checksums": {"train.bin": "a", "val.bin": "x"}}, none)


def test_a_checkpoint_of_an_earlier_lm_resumes_on_the_same_data_prepared_again(tiny_args, tmp_path):
    """Before 2026-12-02 a prepared file of 64 KiB to 4 MiB was digested by its first 64 KiB; a checkpoint of that lm
    on data prepared again since (a cache moved, chat masks of a later version) was refused as 'the training data
    changed', the tokens the same."""
    from lm.prepared_dir import content_digest

    args = ["train.steps=4", "train.ckpt_every=2", "train.eval_every=0"]
    run_dir = train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", *args)), stop_after=2)
    item_file = os.path.join(run_dir, "checkpoints", "2", "dataset", "metadata")
    with open(item_file) as f:
        item = json.load(f)
    cache = next(a.split("=", 1)[1] for a in tiny_args if a.startswith("data.cache_dir="))
    ((name, digest),) = item["checksums"].items()
    # (the session's cache may hold the same shard in several directories, prepared by other tests: any will do)
    path = next(p for p in (os.path.join(cache, d, name) for d in sorted(os.listdir(cache))) if os.path.isfile(p)
                and content_digest(p) == digest)  # fmt: skip
    assert 1 << 16 < os.path.getsize(path) <= 1 << 22  # (a file the two forms digest differently)
    item["checksums"][name] = content_digest(path, first_piece_only=True)  # as the earlier lm wrote it
    assert item["checksums"][name] != digest
    with open(item_file, "w") as f:
        json.dump(item, f)
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", *args)))
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r][-1] == 4


def test_keep_every_keeps_the_steps_a_decay_branches_from(tmp_path, tiny_args):
    """train.keep_every keeps each multiple's checkpoint beside the newest train.keep (the README's wsd recipe
    copied step 1000 of a 20,000-step run that train.keep=3 had deleted); it must be a multiple of ckpt_every."""
    args = args_for(tiny_args, tmp_path / "run", "train.steps=10", "train.ckpt_every=2", "train.keep=1",
                    "train.keep_every=4", "train.eval_every=0")  # fmt: skip
    train(config_lib.load("tiny", args))
    assert sorted(int(s) for s in os.listdir(tmp_path / "run" / "checkpoints") if s.isdigit()) == [4, 8, 10]
    with pytest.raises(config_lib.ConfigError, match="train.keep_every=5 keeps the checkpoints at its multiples, but "
                       "they are written every train.ckpt_every=2 steps; give a multiple of 2"):  # fmt: skip
        config_lib.load("tiny", [*args, "train.keep_every=5"])


# slow: 80 steps evaluated every 5 and a resume (about 45 s); .ci/run runs it after the default suite, which keeps the default run within 15 minutes
@pytest.mark.slow
def test_best_checkpoint_is_kept_and_found_across_a_resume(tmp_path, tiny_args):
    args = _overfitting_run(tmp_path, tiny_args)
    cfg = config_lib.load("tiny", args)
    train(cfg, stop_after=50)  # killed after step 50; the same command resumes
    proc = run_cli("train.py", "tiny", *args, cwd=str(tmp_path))
    assert proc.returncode == 0 and "from step 50" in proc.stdout, proc.stderr[-2000:]
    run = tmp_path / "run"
    val = {r["step"]: r["val_loss"] for r in map(json.loads, open(run / "metrics.jsonl")) if "val_loss" in r}
    best = min(val, key=val.get)
    assert 5 <= best < 50, val  # the test's premise: the best is neither the last nor after the resume
    steps = sorted(int(s) for s in os.listdir(run / "checkpoints") if s.isdigit())
    assert steps == [best, 80]  # keep=1: the latest, plus the best, which the resumed process did not delete
    assert ckpt_lib.find(str(run), best=True) == (str(run / "checkpoints"), best)
    sampled = run_cli("sample.py", str(run), "--best", "--max-new-tokens", "2", cwd=str(tmp_path))
    assert sampled.returncode == 0 and f"sampling {run}/checkpoints/{best}" in sampled.stderr, sampled.stderr
    pretrained_best = pretrained.load(str(run), best=True)[0]
    assert_same_params(pretrained_best, params(run, best))
    with pytest.raises(UserError, match=r"^step=80 and best=True both choose a checkpoint; give one of them$"):
        pretrained.load(str(run), step=80, best=True)  # (the best, silently)


def test_checkpoints_between_evaluations_are_said_to_have_no_loss_for_the_best(tmp_path, tiny_args, capsys):
    """A checkpoint is ranked by its own step's validation loss: with train.ckpt_every=3 and eval_every=2 only steps 6
    and the last had one, and the best (kept, --best) was chosen among those alone, without a word."""
    more = ["train.steps=7", "train.ckpt_every=3", "train.eval_every=2", "train.log_every=1", "train.keep=5"]
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", *more)))
    err = capsys.readouterr().err
    assert ("warning: train.ckpt_every=3 is not a multiple of train.eval_every=2: only checkpoints at multiples of 6 "
            "and the last have a validation loss to choose the best by (kept, --best); make train.ckpt_every a "
            "multiple of train.eval_every\n") in err
    steps = sorted(int(s) for s in os.listdir(tmp_path / "run" / "checkpoints"))
    ranked = [step for step in steps if (tmp_path / "run" / "checkpoints" / str(step) / "metrics").exists()]
    assert steps == [3, 6, 7] and ranked == [6, 7]
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run2", *more, "train.ckpt_every=4")))
    assert "is not a multiple" not in capsys.readouterr().err


def test_a_resume_at_the_last_step_rotates_the_steps_left_over(tmp_path, tiny_args):
    """Orbax rotates only as it saves: a run killed between its final checkpoint's commit and the rotation, resumed by
    the same command, finished with train.keep + 1 steps for good (here: keep lowered on that resume, the same
    left-over steps without a kill)."""
    more = ["train.steps=40", "train.ckpt_every=10", "train.eval_every=0", "train.log_every=10"]
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", *more, "train.keep=3")))
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["20", "30", "40"]
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", *more, "train.keep=2")))
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["30", "40"]


def _train_cmd(run_dir, tiny_args, *more):
    return [sys.executable, os.path.join(ROOT, "train.py"), "tiny", *args_for(tiny_args, run_dir, *more)]


LONG = ["train.steps=600", "train.ckpt_every=100", "train.eval_every=0", "train.log_every=1"]


def _start(cmd, cwd):
    env = dict(os.environ)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path, proc, timeout=120):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("whole")
    tiny_args = [f"data.cache_dir={data_cache}", "logging.progress=false", "train.peak_flops=1e12"]
    proc = subprocess.run(_train_cmd(tmp / "run", tiny_args, *LONG), cwd=tmp, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "run", tiny_args


# slow: about 33 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_sigkill_then_same_command_resumes_exactly(tmp_path, uninterrupted):
    whole, tiny_args = uninterrupted
    cmd = _train_cmd(tmp_path / "run", tiny_args, *LONG)
    proc = _start(cmd, tmp_path)
    _wait_for(tmp_path / "run" / "checkpoints" / "100", proc)
    proc.kill()
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed" in done.stdout
    assert_same_losses(losses(whole), losses(tmp_path / "run"))
    assert_same_params(params(whole, 600), params(tmp_path / "run", 600))
    # TensorBoard shows every step once, as metrics.jsonl does: the killed process's events up to its checkpoint
    # are in its file (tensorboardX's thread flushed every 2 minutes, so they were lost), those after it are purged.
    logged = {row["step"]: row["loss"] for row in read_metrics(str(tmp_path / "run")) if "loss" in row}
    assert tensorboard_scalars(tmp_path / "run", "train/loss") == pytest.approx(logged)


def test_a_run_killed_after_a_checkpoint_keeps_its_tensorboard_points_up_to_it(tmp_path, tiny_args):
    """Logged every 10 steps, a run's first 50 steps are a few kB of events, which tensorboardX kept in its buffer
    for up to 2 minutes: killed just after its checkpoint, the run lost them, and the resume (which purges only
    what comes after the checkpoint) never wrote them again."""
    cmd = _train_cmd(tmp_path / "run", tiny_args, "train.steps=100000", "train.ckpt_every=50", "train.log_every=10",
                     "train.eval_every=0")  # fmt: skip
    proc = _start(cmd, tmp_path)
    _wait_for(tmp_path / "run" / "checkpoints" / "50", proc)
    proc.kill()
    proc.communicate()
    logged = {row["step"]: row["loss"] for row in read_metrics(str(tmp_path / "run")) if "loss" in row and row["step"] <= 50}
    assert sorted(logged) == [10, 20, 30, 40, 50]
    shown = tensorboard_scalars(tmp_path / "run", "train/loss")
    assert {step: value for step, value in shown.items() if step <= 50} == pytest.approx(logged)


def test_sigterm_checkpoints_and_exits_cleanly(tmp_path, uninterrupted):
    whole, tiny_args = uninterrupted
    cmd = _train_cmd(tmp_path / "run", tiny_args, *LONG)
    proc = _start(cmd, tmp_path)
    _wait_for(tmp_path / "run" / "checkpoints" / "100", proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM: stopped after step" in out and f"resume with: {script('train')} run/config.yaml" in out
    stopped = int(out.split("SIGTERM: stopped after step ")[1].split()[0])
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / str(stopped))
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed run from step {stopped}" in done.stdout  # (named from the working directory, tmp_path)
    assert_same_losses(losses(whole), losses(tmp_path / "run"))
    assert_same_params(params(whole, 600), params(tmp_path / "run", 600))


# True: about 10 s, in the slow tier (the default suite's 15 minutes); .ci/run runs it after the default suite
@pytest.mark.parametrize("stdout_to_file", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_closed_terminal_checkpoints_and_stops_the_run(tmp_path, tiny_args, stdout_to_file):
    """An ssh session that drops closes the run's terminal: writes there fail (EIO) and SIGHUP comes. The run died
    where it was, losing the steps since its last checkpoint. Now it stops as on SIGTERM, with a checkpoint; output
    redirected to a file (`train.py > log.txt`) goes on there to the stop line."""
    cmd = _train_cmd(tmp_path / "run", tiny_args, "train.steps=100000", "train.ckpt_every=50", "train.log_every=1",
                     "train.eval_every=0", "logging.progress=true")  # fmt: skip
    terminal, tty = pty.openpty()
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=log if stdout_to_file else tty,
                            stderr=tty, start_new_session=True)  # fmt: skip
    os.close(tty)
    shown, done = [], threading.Event()

    def read():  # what the terminal shows, until it closes
        while not done.is_set():
            if select.select([terminal], [], [], 0.05)[0]:
                with contextlib.suppress(OSError):
                    shown.append(os.read(terminal, 65536))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        _wait_for(tmp_path / "run" / "checkpoints" / "50", proc)
    finally:
        done.set()
        reader.join()
        os.close(terminal)  # the terminal is gone: the run's writes to it fail from here on
    time.sleep(0.5)  # (lines written before SIGHUP comes, as when a terminal hangs up with SIGHUP ignored)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=120) == 0
    log.close()
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "preempted", status
    stopped = max(int(name) for name in os.listdir(tmp_path / "run" / "checkpoints"))
    assert stopped > 50, stopped  # (where SIGHUP came in; step 100 too, where its save was a periodic one)
    assert max(row["step"] for row in read_metrics(str(tmp_path / "run"))) == stopped
    out = (tmp_path / "log.txt").read_text()
    assert (f"SIGHUP: stopped after step {stopped} with a checkpoint" in out) == stdout_to_file, out[-2000:]
    if not stdout_to_file:
        assert b"loss" in b"".join(shown)  # (the terminal showed the run until it closed)


# slow: about 10 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_nohup_trains_on_after_the_terminal_closes(tmp_path, tiny_args):
    """`nohup train.py` (SIGHUP ignored when the run starts) trains on through a SIGHUP, as README advises for
    logging out. The closed-terminal handler took SIGHUP over, and such a run stopped when its terminal closed."""
    cmd = _train_cmd(tmp_path / "run", tiny_args, "train.steps=100000", "train.ckpt_every=50", "train.eval_every=0")
    proc = subprocess.Popen(["nohup", *cmd], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "run" / "checkpoints" / "50", proc)
    proc.send_signal(signal.SIGHUP)
    time.sleep(3)
    assert proc.poll() is None, proc.communicate()  # (it stopped: "SIGHUP: stopped after step N")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "SIGTERM: stopped after step" in out, err[-3000:]


# slow: about 11 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_ctrl_c_stops_a_scripts_background_run_with_a_checkpoint(tmp_path, tiny_args):
    """A script's background job (`python train.py ... & wait`) starts with Ctrl-C ignored, as a non-interactive shell
    leaves it: Ctrl-C (SIGINT to the process group) still stops the run with a checkpoint, as it did before SIGHUP's
    ignore was kept for `nohup`, and not leave it training on after the script is gone."""
    cmd = _train_cmd(tmp_path / "run", tiny_args, "train.steps=100000", "train.ckpt_every=50", "train.eval_every=0")
    script = subprocess.Popen(["sh", "-c", '"$@" & echo $!; wait', "sh", *cmd], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    pid = int(script.stdout.readline())
    _wait_for(tmp_path / "run" / "checkpoints" / "50", script)
    os.kill(pid, signal.SIGINT)
    out, err = script.communicate(timeout=120)
    assert "SIGINT: stopped after step" in out, (out + err)[-3000:]
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "preempted"


# slow: about 13 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_interrupted_save_is_ignored_with_a_warning(tmp_path, tiny_args):
    cfg = config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", *RESUME))
    train(cfg, stop_after=20)
    # What a process killed in the middle of writing step 30 leaves behind.
    partial = tmp_path / "run" / "checkpoints" / "30.orbax-checkpoint-tmp-1700000000"
    (partial / "params").mkdir(parents=True)
    (partial / "params" / "garbage").write_bytes(b"\0" * 10)
    proc = run_cli("train.py", "tiny", *args_for(tiny_args, tmp_path / "run", *RESUME), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ignoring incomplete checkpoint 30.orbax-checkpoint-tmp-1700000000" in proc.stderr
    assert "from step 20" in proc.stdout
    assert not partial.exists()


MESH_SCRIPT = """
import sys
from lm import config
from lm.train import train
train(config.load("tiny", sys.argv[2:]), stop_after=int(sys.argv[1]) or None)
"""


def _run_on_devices(n, args, cwd, stop_after=0):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(f"--xla_force_host_platform_device_count={n}")}  # n host devices
    cmd = [sys.executable, "-c", MESH_SCRIPT, str(stop_after), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# Both directions are slow (about 25 s each; the default suite reached 15 min): test_sharding's
# test_checkpoint_moves_between_meshes restores under another mesh in the default run.
@pytest.mark.parametrize("first, second", [pytest.param(1, 8, marks=pytest.mark.slow), pytest.param(8, 1, marks=pytest.mark.slow)])
def test_restore_under_a_different_device_count(tmp_path, tiny_args, first, second):
    base = ["train.steps=20", "train.ckpt_every=10", "train.eval_every=10", "train.log_every=1"]
    _run_on_devices(1, args_for(tiny_args, tmp_path / "whole", *base), tmp_path)
    _run_on_devices(first, args_for(tiny_args, tmp_path / "moved", *base), tmp_path, stop_after=10)
    out = _run_on_devices(second, args_for(tiny_args, tmp_path / "moved", *base), tmp_path)
    assert f"{second} cpu device{'s' if second > 1 else ''}," in out and "from step 10" in out
    later = lambda rows: [r for r in rows if r["step"] > 10]
    assert_same_losses(later(losses(tmp_path / "whole")), later(losses(tmp_path / "moved")), rtol=1e-5)


def test_resume_refuses_a_different_model(tmp_path, tiny_args):
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", "train.steps=10")))
    proc = run_cli("train.py", "tiny", *args_for(tiny_args, tmp_path / "run", "model.n_layer=3"), cwd=str(tmp_path))
    assert_user_error(proc, "different model", "n_layer 2 vs 3")


# slow: about 14 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_resume_may_change_the_attention_implementation(tmp_path, tiny_args):
    # Same parameters, same function: a run moves between backends (cudnn on a GPU, xla on a CPU). On a CPU
    # dot_product runs lm's einsum attention, which rounds differently from jax's xla: the same losses to 1e-5.
    base = ["train.steps=20", "train.ckpt_every=10", "train.eval_every=10", "train.log_every=1"]
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "whole", *base)))
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "moved", *base)), stop_after=10)
    proc = run_cli("train.py", "tiny", *args_for(tiny_args, tmp_path / "moved", *base, "model.attention=xla"),
                   cwd=str(tmp_path))
    assert proc.returncode == 0 and "from step 10" in proc.stdout, proc.stderr[-2000:]
    assert config_lib.load(str(tmp_path / "moved" / "config.yaml")).model.attention == "xla"
    later = lambda rows: [r for r in rows if r["step"] > 10]
    assert_same_losses(later(losses(tmp_path / "whole")), later(losses(tmp_path / "moved")), rtol=1e-5)


# slow: about 12 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_resume_may_change_the_training_options(tmp_path, tiny_args):
    # dropout, remat and the compute dtype change how the same parameters train, not what they are.
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", "train.steps=20", "train.ckpt_every=10")),
          stop_after=10)
    changed = ["model.dropout=0.1", "model.attn_dropout=0.1", "model.remat=full", "model.dtype=bfloat16"]
    proc = run_cli("train.py", "tiny", *args_for(tiny_args, tmp_path / "run", "train.steps=20", *changed),
                   cwd=str(tmp_path))
    assert proc.returncode == 0 and "from step 10" in proc.stdout, proc.stderr[-2000:]
    saved = config_lib.load(str(tmp_path / "run" / "config.yaml")).model
    assert (saved.dropout, saved.remat, saved.dtype) == (0.1, "full", "bfloat16")


def test_resume_refuses_a_different_tokenizer(tmp_path, tiny_args):
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", "train.steps=10", "model.vocab_size=512")))
    # Same model shape (vocab fixed at 512), but the data now comes from a BPE tokenizer.
    proc = run_cli(
        "train.py", "tiny", *args_for(tiny_args, tmp_path / "run", "model.vocab_size=512", "data.tokenizer=bpe:300"),
        f"data.cache_dir={tmp_path / 'cache'}", cwd=str(tmp_path),
    )
    assert_user_error(proc, "different tokenizers", "bytes vs bpe:300")
    assert proc.stderr.endswith("set data.tokenizer=bytes (and data.path) to match the checkpoint, or start a new run "
                                "(run.dir=NEW)\n"), proc.stderr  # fmt: skip
    # Refused before the BPE was trained and the corpus tokenized with it (hours, on a large corpus)
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache")
    # From its config.yaml (model.vocab_size=512 there), a tokenizer of more tokens was "model.vocab_size=512 is
    # smaller than the tokenizer's 600 tokens; set 0", and then, so set, "trained with a different model"
    saved = str(tmp_path / "run" / "config.yaml")
    for more in [[], ["model.vocab_size=0"]]:
        changed = r"checkpoints/10 and the data use different tokenizers \(bytes vs bpe:600\)"
        with pytest.raises(UserError, match=changed):
            train(config_lib.load(saved, ["data.tokenizer=bpe:600", "train.steps=20", *more]))


def test_a_rank_file_edited_since_the_checkpoint_is_named_as_such(tmp_path, tiny_args):
    """A .tiktoken file changed after training: the resume said "different ranks (trained on other data)" and to set
    data.tokenizer to match the checkpoint, which it matched, by name."""
    from lm.data.prepare import prepare

    (tmp_path / "small.txt").write_text(open(BUNDLED_CORPUS).read()[:20000])
    prepare([str(tmp_path / "small.txt")], "bpe:300", str(tmp_path / "bpe"), progress=False)
    rank_file = tmp_path / "custom.tiktoken"
    shutil.copy(tmp_path / "bpe" / "tokenizer.tiktoken", rank_file)
    args = args_for(tiny_args, tmp_path / "run", "train.steps=2", f"data.tokenizer={rank_file}",
                    f"data.path={tmp_path / 'small.txt'}")  # fmt: skip
    train(config_lib.load("tiny", args))
    lines = rank_file.read_text().splitlines()
    (first, a), (second, b) = lines[-1].split(), lines[-2].split()
    rank_file.write_text("\n".join([*lines[:-2], f"{first} {b}", f"{second} {a}"]) + "\n")  # two ranks swapped
    with pytest.raises(UserError, match=r"checkpoints/2 was trained with other ranks than .*custom.tiktoken holds now "
                                        r"\(the file changed, or another one was given\); restore the file"):
        train(config_lib.load(str(tmp_path / "run" / "config.yaml"), ["train.steps=4"]))


# slow: about 15 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_second_run_on_the_same_directory_is_refused_while_the_first_trains(tmp_path, tiny_args):
    """Two runs of one run directory wrote the same checkpoints (each failing the other's saves, and a restore
    then called the intact ones unreadable); the run holds the directory's lock, and a second is one line."""
    from lm.run_dir import RunDir

    args = args_for(tiny_args, tmp_path / "run", "train.steps=3", "train.eval_every=0")
    train(config_lib.load("tiny", args))  # a run that exists
    with RunDir("gs://bucket//runs/a/").lock():  # a run in a bucket: its lock is its URL's, however spelled
        with pytest.raises(UserError, match="another process .* is training gs://bucket/runs/a;"):
            with RunDir("gs://bucket/runs/a").lock():
                pass
    with RunDir(str(tmp_path / "run")).lock():  # as a run training there holds it
        proc = run_cli("train.py", "tiny", *args, "train.steps=6", cwd=str(tmp_path))
        assert_user_error(proc, f"another process (pid {os.getpid()}) is training {tmp_path / 'run'}; wait for it")
        assert ckpt_lib.complete_steps(str(tmp_path / "run" / "checkpoints")) == [3]  # untouched
        with pytest.raises(UserError, match="another process"):  # a new run directory: refused once made, too
            with RunDir(str(tmp_path / "new")).lock():
                train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "new", "train.steps=3")))
    proc = run_cli("train.py", "tiny", *args, "train.steps=6", cwd=str(tmp_path))  # released: it resumes
    assert proc.returncode == 0 and "resumed" in proc.stdout, proc.stderr[-3000:]


# slow: about 9 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_step_being_read_stays_while_its_run_trains_on(tmp_path, tiny_args, capsys):
    """sample.py, lm.export and a LoRA run's start read the newest step of a run that still trained, which its rotation
    (train.keep) deleted as they read it: "checkpoint .../N is damaged ...; move this one away". A reader now holds the
    step it chose (a shared lock in RUN/pinned/) and the rotation keeps it; one the rotation is deleting (it holds
    that lock) is passed over for the newer step being saved, or refused where the user named it."""
    import fcntl
    import threading

    from lm.run_dir import RunDir

    run = str(tmp_path / "run")
    ckpts = os.path.join(run, "checkpoints")
    args = args_for(tiny_args, run, "train.steps=4", "train.ckpt_every=2", "train.keep=2", "train.eval_every=0")
    train(config_lib.load("tiny", args))
    assert ckpt_lib.complete_steps(ckpts) == [2, 4]
    with RunDir(run).lock():  # as the run training there holds it
        os.makedirs(os.path.join(run, "pinned"))
        with open(ckpt_lib._reading_lock(run, 4), "a") as deleting:  # as its rotation, having chosen to delete 4
            fcntl.flock(deleting, fcntl.LOCK_EX)
            with pytest.raises(UserError, match=f"checkpoint {ckpts}/4 is being deleted by its run's checkpoint rotation"):
                ckpt_lib.find(run, step=4)
            saved = threading.Timer(1.0, shutil.copytree, (f"{ckpts}/4", f"{ckpts}/6"))  # the save under way ends
            saved.start()
            assert ckpt_lib.find(run) == (ckpts, 6)
            saved.join()
            assert f"waiting for the checkpoint that {run} is saving: its rotation is deleting step 4" in capsys.readouterr().err
        assert ckpt_lib.find(run, step=2) == (ckpts, 2)  # held by this process from now on
    shutil.rmtree(f"{ckpts}/6")  # (and this process lets go of it)
    os.close(ckpt_lib._READING.pop(ckpt_lib._reading_lock(run, 6)))
    train(config_lib.load("tiny", [*args, "train.steps=10", "train.keep=1"]))  # the run trains on; 2 is being read
    assert ckpt_lib.complete_steps(ckpts) == [2, 10]
    assert sorted(os.listdir(os.path.join(run, "pinned"))) == ["read-2.lock"]  # (the rotation's own are deleted)
    os.close(ckpt_lib._READING.pop(ckpt_lib._reading_lock(run, 2)))  # the reader ends
    train(config_lib.load("tiny", [*args, "train.steps=12", "train.keep=1"]))
    assert ckpt_lib.complete_steps(ckpts) == [12]
    assert ckpt_lib.find(run) == (ckpts, 12) and ckpt_lib._reading_lock(run, 12) in ckpt_lib._READING
    open(ckpt_lib._reading_lock(run, 10), "w").close()  # as a reader killed before it let go leaves its file
    ckpt_lib.release_reading()  # (at exit, or a server once it has loaded the weights)
    assert not ckpt_lib._READING and not os.path.exists(os.path.join(run, "pinned"))  # (no other reader held 12)


def test_a_new_run_on_a_full_disk_names_its_lock_file(tmp_path, monkeypatch):
    """The lock file of a new run is empty, and the pid written into it needs a block: on a full disk that was an
    OSError that the command line reported as "cannot write the output" (as if stdout were full), naming no file."""
    import errno

    from lm import run_dir

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(run_dir.os, "pwrite", full)
    lock = tmp_path / "run" / ".lock"
    with pytest.raises(UserError, match=f"cannot write {re.escape(str(lock))}: No space left on device; free space"):
        with run_dir.RunDir(str(tmp_path / "run")).lock():
            pass


def test_a_run_on_a_read_only_disk_is_resumed_from_a_copy_not_started_over(tmp_path, monkeypatch):
    """The advice was "set run.dir to a writable directory", which, followed with a run's own config.yaml, trained
    it again from step 0 there; a new run's directory is still to be set elsewhere."""
    import errno

    from lm import run_dir

    real_open = os.open

    def read_only(path, *args, **kwargs):
        if str(path).endswith(run_dir.LOCK):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_open(path, *args, **kwargs)

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    monkeypatch.setattr(run_dir.os, "open", read_only)
    with pytest.raises(UserError, match="set run.dir to a writable directory$"):
        with run_dir.RunDir(str(run)).lock():
            pass
    (run / "config.yaml").write_text("")  # a run's own: its config.yaml beside its checkpoints
    with pytest.raises(UserError) as caught:
        with run_dir.RunDir(str(run)).lock():
            pass
    assert str(caught.value) == (
        f"cannot write run directory {run}: Read-only file system; make it writable (was it remounted read-only?), "
        f"or copy the run to a writable directory and resume the copy: {command_line('train')} COPY/config.yaml"
    )
    monkeypatch.setattr(sys, "argv", ["/venv/bin/lm-train"])  # (the console script: no train.py to run there)
    with pytest.raises(UserError, match=r"resume the copy: lm-train COPY/config.yaml$"):
        with run_dir.RunDir(str(run)).lock():
            pass


def test_a_lock_file_deleted_as_it_is_locked_is_opened_and_locked_again(tmp_path, monkeypatch):
    """A reader letting go of a step (or the rotation, deleting one) deletes its lock file while holding it
    exclusively. A process that had opened that file before, and locked it after, held a lock on a deleted file that
    no other process would open: a reader's shared lock that the rotation never saw, or the rotation's exclusive
    one that a new reader never saw, and the step deleted as it was read."""
    from lm import files

    path = str(tmp_path / "read-4.lock")
    open(path, "w").close()
    opened = os.open

    def opened_then_deleted(name, *args):
        fd = opened(name, *args)
        if name == path and not deleted:
            deleted.append(os.remove(name))  # by the process that held it, as this one waits to lock it
        return fd

    for shared in (True, False):
        deleted = []
        monkeypatch.setattr(files.os, "open", opened_then_deleted)
        fd = files.lock_file(path, shared)
        monkeypatch.undo()
        assert deleted and os.path.samestat(os.fstat(fd), os.stat(path))  # the file now at the path, locked
        assert files.lock_file(path, shared=not shared) is None  # (so the other kind of lock waits for it)
        os.close(fd)


def test_the_rotation_holds_the_lock_of_a_step_it_deletes_though_a_reader_deleted_its_directory(tmp_path, monkeypatch):
    """(A reader letting go deletes RUN/pinned/ when it leaves it empty; a rotation that found it gone between making
    it and opening the lock file went on to delete the step without its lock, which a new reader could then take.)"""
    rotation = ckpt_lib._Rotation(None, str(tmp_path))
    locked = ckpt_lib.lock_file
    calls = []

    def directory_deleted_first(path, shared):
        calls.append(path)
        if len(calls) == 1:
            os.rmdir(os.path.dirname(path))  # the reader letting go
        return locked(path, shared)

    monkeypatch.setattr(ckpt_lib, "lock_file", directory_deleted_first)
    assert rotation._lock(4) and len(calls) == 2
    monkeypatch.undo()
    assert ckpt_lib._reading_lock(str(tmp_path), 4) in rotation._deleting
    assert not ckpt_lib.hold_for_reading(str(tmp_path / "checkpoints"), 4)  # (a reader is refused it)
    rotation.release()


def test_resume_modes(tmp_path, tiny_args):
    """A resume mode refuses before the data is prepared (which a large corpus takes hours for): no cache is made."""
    unprepared = f"data.cache_dir={tmp_path / 'cache'}"
    (tmp_path / "empty").mkdir()
    for run_dir in ("run", "empty"):
        args = args_for(tiny_args, tmp_path / run_dir, "resume=required", unprepared)
        assert_user_error(run_cli("train.py", "tiny", *args, cwd=str(tmp_path)), "resume=required", "no checkpoint")
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", "train.steps=10")))
    proc = run_cli("train.py", "tiny", *args_for(tiny_args, tmp_path / "run", "resume=never", unprepared),
                   cwd=str(tmp_path))  # fmt: skip
    assert_user_error(proc, "resume=never")
    assert not (tmp_path / "cache").exists()


# slow: about 17 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_resumed_full_fine_tune_keeps_the_init_from_it_started_from(tmp_path, tiny_args, capsys):
    """(On resume a full fine-tune reads its checkpoint, never init_from: another init_from, or the same base run
    that has trained on since, was silently written into its config.yaml, naming weights it never used.)"""
    base = train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "base", "train.steps=2", "train.ckpt_every=2")))
    other = train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "other", "train.steps=2", "train.ckpt_every=2")))
    ft = lambda *more: config_lib.load("tiny", args_for(tiny_args, tmp_path / "ft", "train.ckpt_every=2", *more))
    run = train(ft("train.steps=2", f"init_from={base}"))
    started = config_lib.load(os.path.join(run, "config.yaml"), []).init_from
    assert started == f"{base}/checkpoints/2"
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "base", "train.steps=4", "train.ckpt_every=2")))
    capsys.readouterr()
    train(ft("train.steps=4", f"init_from={base}"))  # the same command: the base's newest step is now 4
    assert config_lib.load(os.path.join(run, "config.yaml"), []).init_from == started
    assert "init_from" not in capsys.readouterr().err
    train(ft("train.steps=6", f"init_from={other}"))
    assert config_lib.load(os.path.join(run, "config.yaml"), []).init_from == started
    assert f"warning: init_from={other} is not read on resume: the run goes on from its checkpoint (it started " \
        f"from {started})" in capsys.readouterr().err
    # ... so it resumes where its base is gone (rotated away, deleted): it read init_from's model at every start
    shutil.rmtree(tmp_path / "base")
    train(config_lib.load(os.path.join(run, "config.yaml"), ["train.steps=8"]))
    assert config_lib.load(os.path.join(run, "config.yaml"), []).init_from == started
    assert max(r["step"] for r in losses(run)) == 8


# slow: about 12 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_run_from_weights_without_position_parameters_may_extend_their_context(tmp_path, tiny_args):
    """Context extension: RoPE has no parameter that depends on the context, so a run from such weights may set a
    longer model.max_seq_len and stretch RoPE (model.rope_*), LoRA's too; they were refused as another architecture,
    and model.rope_theta as if the weights' positions were learned. A longer block alone names the fix; learned
    positions say why they cannot grow."""
    run = lambda name, *more: train(config_lib.load("tiny", args_for(tiny_args, tmp_path / name, "train.steps=1",
                                                                     "train.ckpt_every=1", "train.eval_every=0", *more)))  # fmt: skip
    base = run("base", "model.pos=rope")
    stretch = ["model.max_seq_len=64", "data.block_size=64", "model.rope_scaling=linear", "model.rope_factor=2",
               "model.rope_theta=20000"]  # fmt: skip
    for name, more in (("long", []), ("long_lora", ["lora.rank=2"])):
        longer = run(name, f"init_from={base}", *stretch, *more)
        m = config_lib.load(os.path.join(longer, "config.yaml"), []).model
        assert (m.max_seq_len, m.rope_scaling, m.rope_factor, m.rope_theta, m.pos) == (64, "linear", 2.0, 20000.0, "rope")
        params, model_cfg, _ = pretrained.load(longer)  # (a LoRA run's base: read again, and accepted)
        prompt = list(range(1, 51))  # longer than the base's context of 32
        sample = generate(params, model_cfg, get_tokenizer("bytes"), [prompt], SampleConfig(max_new_tokens=8, temperature=0))
        assert len(sample[0].tokens) == 8
    with pytest.raises(UserError, match=r"data.block_size=64 is longer than init_from's context, model.max_seq_len=32; "
                       r"lower data.block_size, or extend the context: model.max_seq_len=64 \(no parameter of "
                       r"model.pos=rope depends on it\)$"):  # fmt: skip
        run("block", f"init_from={base}", "data.block_size=64")
    learned = run("learned")
    with pytest.raises(UserError, match=r"model.max_seq_len=64 \(the weights have 32; learned positions have a row each"):
        run("no", f"init_from={learned}", "model.max_seq_len=64", "data.block_size=64")
    # The weights' positions are not the run's to change: the advice is to drop RoPE's options (not to set model.pos)
    with pytest.raises(UserError, match=r"model.rope_theta=20000.0 applies only to model.pos=rope, and init_from's "
                       r"weights have model.pos=learned; drop model.rope_theta$"):  # fmt: skip
        run("no_theta", f"init_from={learned}", "model.rope_theta=20000")
    with pytest.raises(UserError, match=r"model.rope_scaling=linear scales RoPE, and init_from's weights have "
                       r"model.pos=learned; drop model.rope_scaling and any other model.rope_\* setting$"):  # fmt: skip
        run("no_scaling", f"init_from={learned}", "model.rope_scaling=linear", "model.rope_factor=2")


def test_init_from_loads_parameters_only(tmp_path, tiny_args):
    src = train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "src", "train.steps=10")))
    for path in (src, os.path.join(src, "checkpoints", "10")):
        dst = tmp_path / f"dst{len(str(path))}"
        train(config_lib.load("tiny", args_for(tiny_args, dst, "train.steps=1", "train.ckpt_every=1", f"init_from={path}")))
        # One step from the source parameters, with a fresh optimizer: step 1 of a fresh run.
        rows = [r for r in losses(dst) if "loss" in r]
        fresh_first = losses(src)[0]
        assert rows[0]["step"] == 1 and rows[0]["loss"] < fresh_first["loss"] - 0.3
        # The starting model is evaluated first: the source's final validation loss, exactly.
        assert losses(dst)[0] == {"step": 0, "val_loss": losses(src)[-1]["val_loss"]}


def test_init_from_errors(tmp_path, tiny_args):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli("train.py", "tiny", *args_for(tiny_args, tmp_path / "run", f"init_from={empty}"), cwd=str(tmp_path))
    assert_user_error(proc, "no checkpoint found in", str(empty))
    proc = run_cli("train.py", "tiny", *args_for(tiny_args, tmp_path / "run", "init_from=/no/such/run"), cwd=str(tmp_path))
    assert_user_error(proc, "/no/such/run does not exist")


def test_a_file_given_as_the_run_names_its_directory(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("model: {}\n")  # a run's config.yaml given for the run
    with pytest.raises(UserError, match=r"config.yaml is a file; give the run directory that holds it \(.*run\)"):
        ckpt_lib.find(str(tmp_path / "run" / "config.yaml"))  # (it said "no checkpoint found ...; train first")


def test_a_run_stopped_before_its_first_checkpoint_says_how_to_train_it(tmp_path):
    """A run stopped during its start-up (config.yaml written, no step yet) said "no checkpoint found; train first
    (python train.py)", which started another run; it names the command that trains this one."""
    from lm import runs as runs_lib

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    runs_lib.write_status(str(run), "stopped")
    with pytest.raises(UserError) as raised:
        ckpt_lib.find(str(run))
    resume = f"{command_line('train')} {run / 'config.yaml'}"
    assert str(raised.value) == (f"{run} has no checkpoint: its run ended before its first one; train it with "
                                 f"{resume}, or give another run")
    runs_lib.write_status(str(run), "running")  # (this process: alive, before its first checkpoint)
    with pytest.raises(UserError, match=r"has no checkpoint yet: its run is still training toward its first one"):
        ckpt_lib.find(str(run))


def test_a_run_stopped_before_writing_its_config_says_how_to_train_it(tmp_path):
    """A run stopped while compiling its start-up (status.json only: config.yaml is written once its state is built)
    said "no checkpoint found; train first (python train.py)", which started another run; while it still compiles,
    the same, where it is to be waited for."""
    from lm import runs as runs_lib

    run = tmp_path / "run"
    run.mkdir()
    runs_lib.write_status(str(run), "running")  # (this process: alive, compiling)
    with pytest.raises(UserError, match=r"has no checkpoint yet: its run is still training toward its first one"):
        ckpt_lib.find(str(run))
    runs_lib.write_status(str(run), "stopped")
    with pytest.raises(UserError) as raised:
        ckpt_lib.find(str(run))
    assert str(raised.value) == (f"{run} has no checkpoint: its run ended during its start-up, before writing its "
                                 f"config.yaml; run the {command_line('train')} command that started it again, or "
                                 "give another run")


@pytest.mark.parametrize("damaged, said", [
    ('[1]', "has no checkpoint: its run ended during its start-up"),
    ('{"status": "running", "pid": "abc", "started": 1.0, "host": "HOST"}', "is still training toward its first one"),
])  # fmt: skip
def test_a_damaged_status_of_a_run_without_a_checkpoint_is_read_as_lm_runs_reads_it(tmp_path, damaged, said):
    """status.json read as lm.runs reads it (read_status: a non-object is empty, a field of another type dropped, and
    a "running" without its pid stays as it says): a list, or a pid that is no number, was a traceback
    (AttributeError, TypeError) where the line says what to do."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "status.json").write_text(damaged.replace("HOST", socket.gethostname()))
    with pytest.raises(UserError, match=said):
        ckpt_lib.find(str(run))


def test_a_directory_of_runs_names_the_newest_run(tmp_path):
    """`sample.py runs` (runs/NAME meant) said "no checkpoint found; train first" of a directory of trained runs."""
    for name in ("a", "b"):
        (tmp_path / "runs" / name / "checkpoints" / "5").mkdir(parents=True)
        (tmp_path / "runs" / name / "config.yaml").write_text("model: {}\n")
        time.sleep(0.05)  # (b is the newer)
    runs = tmp_path / "runs"
    with pytest.raises(UserError) as raised:
        ckpt_lib.find(str(runs))
    assert str(raised.value) == (f"{runs} is a directory of runs, not a run; give one of them, e.g. {runs / 'b'} "
                                 f"(2 runs there; `python -m lm.runs {runs}` lists them)")  # fmt: skip


def test_a_file_outside_any_run_names_no_directory_to_give(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "replies.jsonl").write_text("{}\n")  # the fine-tune's data given as init_from, say
    with pytest.raises(UserError) as raised:
        ckpt_lib.find(str(tmp_path / "data" / "replies.jsonl"))
    # (it said to give "the run directory that holds it (.../data)", which holds no run: refused again)
    assert str(raised.value).endswith("is a file; give a run directory (runs/NAME) or a checkpoint step directory")
    # A directory inside a step (RUN/checkpoints/N/params) said "no checkpoint found; train first".
    step = tmp_path / "run" / "checkpoints" / "4"
    for item in ckpt_lib.READ:
        (step / item).mkdir(parents=True)
    with pytest.raises(UserError, match=f"^{re.escape(str(step / 'params'))} is a part of checkpoint step "
                       f"{re.escape(str(step))}; give that step directory$"):  # fmt: skip
        ckpt_lib.find(str(step / "params"))


# slow: about 9 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_unwritable_run_directory(tmp_path, tiny_args):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = run_cli("train.py", "tiny", *args_for(tiny_args, blocker / "run"), cwd=str(tmp_path))
    assert_user_error(proc, "cannot write run directory", str(blocker / "run"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("")  # a file where the checkpoints go: one line, not a traceback
    for command in ("train.py", "sample.py"):
        args = ["tiny", *args_for(tiny_args, tmp_path / "run")] if command == "train.py" else [str(tmp_path / "run")]
        assert_user_error(run_cli(command, *args, cwd=str(tmp_path)), "checkpoints is a file, where a run keeps")


@pytest.mark.parametrize("error", [
    OSError(28, "No space left on device"),
    # tensorstore's, for a full disk: it was said as a training step that does not fit in the device's memory
    ValueError('RESOURCE_EXHAUSTED: Error writing local file "x/_sharding": Failed to write 3505 bytes to file 9: No '
               "space left on device [os_error_code='28']"),
])  # fmt: skip
def test_background_save_failure_is_an_error(tmp_path, tiny_args, monkeypatch, error):
    async def fail(*args, **kwargs):  # fails in the background writer, not in the save call
        raise error

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "async_save", fail)
    with pytest.raises(UserError, match="writing a checkpoint to .* failed .*No space left on device"):
        train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", "train.steps=10")))


# slow: about 14 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_damaged_validation_loss_file_is_set_aside_not_a_traceback(tmp_path, tiny_args):
    """orbax reads every step's metrics file (its validation loss) as a manager starts: one that was not JSON made
    resuming and `sample.py --best` tracebacks. Reading is refused in one line; a resume sets the file aside and
    goes on from the latest step, whose arrays are unharmed."""
    args = args_for(tiny_args, tmp_path / "run", *RESUME, "train.keep=5")
    cfg = config_lib.load("tiny", args)
    train(cfg, stop_after=30)
    metrics = tmp_path / "run" / "checkpoints" / "20" / "metrics" / "metrics"
    assert json.loads(metrics.read_text())["val_loss"] > 0
    metrics.write_text("")
    best = run_cli("sample.py", str(tmp_path / "run"), "--best", "--max-new-tokens", "2", cwd=str(tmp_path))
    assert_user_error(best, f"{metrics} (a checkpoint's validation loss) is damaged; move it away")
    proc = run_cli("train.py", "tiny", *args, cwd=str(tmp_path))
    assert proc.returncode == 0 and "from step 30" in proc.stdout, proc.stderr[-3000:]
    assert f"warning: {metrics} (a checkpoint's validation loss) is damaged; set aside as metrics.unreadable" in proc.stderr
    assert (metrics.parent / "metrics.unreadable").is_file() and not metrics.exists()
    assert ckpt_lib.find(str(tmp_path / "run"), best=True)[1] != 20  # no longer ranked


@pytest.mark.parametrize("damage", [
    "truncate_array", pytest.param("empty_config", marks=pytest.mark.slow),
    pytest.param("delete_metadata", marks=pytest.mark.slow),
    pytest.param("delete_tokenizer", marks=pytest.mark.slow), pytest.param("empty_dataset", marks=pytest.mark.slow),
])  # fmt: skip
def test_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path, tiny_args, damage):
    """A step whose arrays, or whose config, tokenizer or dataset record, cannot be read is set aside (renamed
    .unreadable) and the one before resumed, exactly. (A damaged record was skipped without being set aside, so
    the step's next save failed at every resume; a damaged tokenizer or dataset record was a traceback.) Readers
    (sample.py) say in one line which step is damaged."""
    args = args_for(tiny_args, tmp_path / "run", *RESUME)
    whole = train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "whole", *RESUME)))
    cfg = config_lib.load("tiny", args)
    train(cfg, stop_after=30)
    latest = tmp_path / "run" / "checkpoints" / "30"
    if damage == "truncate_array":
        for data in (latest / "params").rglob("d/*"):
            if data.is_file():
                data.write_bytes(data.read_bytes()[:7])
    elif damage == "delete_metadata":
        (latest / "train" / "_METADATA").unlink()
    elif damage == "delete_tokenizer":
        shutil.rmtree(latest / "tokenizer")
    else:
        (latest / damage.removeprefix("empty_") / "metadata").write_text("")
    if damage == "empty_config":
        read = run_cli("sample.py", str(tmp_path / "run"), "--prompt", "a", "--max-new-tokens", "2", cwd=str(tmp_path))
        assert_user_error(read, f"checkpoint {latest} is damaged (its config cannot be read", "give another")
    (tmp_path / "run" / "checkpoints" / "30.unreadable").mkdir()  # an earlier step 30 was set aside already
    proc = run_cli("train.py", "tiny", *args, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint" in proc.stderr and "/30 cannot be restored" in proc.stderr
    assert "set aside as 30.unreadable-2, trying an older one" in proc.stderr  # the name it was given
    assert "See full TensorStore details" not in proc.stderr  # (a pointer that printed as '<bound method ...>')
    assert "resumed" in proc.stdout and "from step 20" in proc.stdout
    assert (tmp_path / "run" / "checkpoints" / "30.unreadable-2" / "params").is_dir()  # kept, beside the earlier one
    aside = str(tmp_path / "run" / "checkpoints" / "30.unreadable-2")
    assert_user_error(run_cli("sample.py", aside, cwd=str(tmp_path)), "is a checkpoint set aside as unreadable")
    assert_same_losses(losses(whole), losses(tmp_path / "run"))
    assert_same_params(params(whole, 40), params(tmp_path / "run", 40))


# slow: about 20 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_run_whose_every_checkpoint_was_set_aside_does_not_start_over(tmp_path, tiny_args):
    """(Every step set aside, the run stopped saying to move the directory away; the same command again started the
    run over in it, from step 0, over its metrics.) It is refused in one line until a step is renamed back."""
    args = args_for(tiny_args, tmp_path / "run", "train.steps=20", "train.ckpt_every=10", "train.eval_every=0")
    train(config_lib.load("tiny", args))
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in ("10", "20"):
        (checkpoints / step / "train" / "_METADATA").rename(checkpoints / f"{step}.metadata")
    proc = run_cli("train.py", "tiny", *args, "train.steps=30", cwd=str(tmp_path))
    assert_user_error(proc, f"no checkpoint in {checkpoints} can be restored")
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    proc = run_cli("train.py", "tiny", *args, "train.steps=30", cwd=str(tmp_path))
    run = "run"  # (as shown: relative to the working directory)
    assert_user_error(proc, f"every checkpoint of {run} was set aside as unreadable (10.unreadable, 20.unreadable)",
                      f"rename one back to resume ({run}/checkpoints/20.unreadable to {run}/checkpoints/20)")  # fmt: skip
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics
    proc = run_cli("sample.py", "run", "--max-new-tokens", "2", cwd=str(tmp_path))  # (was "no checkpoint found")
    assert_user_error(proc, f"of {tmp_path / 'run'} was set aside as unreadable (10.unreadable, 20.unreadable); once")
    (checkpoints / "20.metadata").rename(checkpoints / "20.unreadable" / "train" / "_METADATA")
    (checkpoints / "20.unreadable").rename(checkpoints / "20")
    proc = run_cli("train.py", "tiny", *args, "train.steps=30", cwd=str(tmp_path))
    assert proc.returncode == 0 and "from step 20" in proc.stdout, proc.stderr[-3000:]


def test_a_damaged_tokenizer_item_is_named_as_the_checkpoints_damage(tmp_path, tiny_args, monkeypatch):
    """A stored tokenizer without its spec, or with ranks that are no text, was a traceback (KeyError, TypeError);
    stored ranks with lines lost blamed the cache's copy ("prepare the data again"), and a resume called them another
    tokenizer's. Each is the checkpoint's damage, in one line."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    args = args_for(tiny_args, tmp_path / "run", "data.tokenizer=bpe:300", "train.steps=1")
    train(config_lib.load("tiny", args))
    checkpoints, item = str(tmp_path / "run" / "checkpoints"), tmp_path / "run" / "checkpoints" / "1" / "tokenizer"
    metadata = item / "metadata"
    stored = json.loads(metadata.read_text())
    lines = stored["ranks"].rstrip("\n").split("\n")
    for damaged, said in [({**stored, "spec": None}, "it is no tokenizer record"),
                          ({**stored, "ranks": 5}, "it is no tokenizer record"),
                          ({**stored, "ranks": "\n".join(lines[:-10]) + "\n"},
                           "its stored ranks make no bpe:300 tokenizer (")]:  # fmt: skip
        metadata.write_text(json.dumps(damaged))
        with pytest.raises(ckpt_lib.Damaged, match=f"checkpoint {checkpoints}/1 is damaged \\(its tokenizer cannot be "
                           f"read: {re.escape(said)}"):  # fmt: skip
            ckpt_lib.load_tokenizer(checkpoints, 1)
    with pytest.raises(ckpt_lib.Damaged, match="its stored ranks make no bpe:300 tokenizer"):  # (not "other ranks")
        train(config_lib.load("tiny", [*args, "train.steps=2"]))


def _signal_during_prepare(tmp_path, sig, *more):
    """Start a run on a 16 MB corpus and send `sig` once it is training its tokenizer: start-up, before any step."""
    corpus = tmp_path / "big.txt"
    if not corpus.exists():
        words = open(os.path.join(ROOT, "lm", "assets", "tinyshakespeare.txt")).read().split()[:20000]
        corpus.write_text(" ".join(words[(i * 7919) % len(words)] for i in range(3_000_000)))
    stderr = open(tmp_path / "stderr.txt", "w+")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "tiny", f"run.dir={tmp_path / 'run'}",
           f"data.cache_dir={tmp_path / 'data'}", f"data.path={corpus}", "data.tokenizer=bpe:1000", *more]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=dict(os.environ), stdout=subprocess.PIPE,
                            stderr=stderr, text=True)
    deadline = time.time() + 120
    while "training tokenizer" not in (tmp_path / "stderr.txt").read_text():
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "stderr.txt").read_text()
        time.sleep(0.02)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out, (tmp_path / "stderr.txt").read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_start_up_ends_cleanly(tmp_path, sig):
    code, out, err = _signal_during_prepare(tmp_path, sig)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert f"{signal.Signals(sig).name} during start-up: stopped before training" in err.splitlines()[-1]
    # Nothing half-written: no prepared directory that looks complete, no temporary files, no run.
    written = [p.name for p in (tmp_path / "data").rglob("*")]
    assert not any(name == "meta.json" or name.endswith(".tmp") for name in written), written
    assert not (tmp_path / "run" / "checkpoints").exists()


FINALIZER_SIGNAL = r"""
import gc, signal, sys
from lm.errors import Stopped, _quiet_background_failures
from lm.loop import Signals

_quiet_background_failures()


class Finalized:
    def __del__(self):  # a library's finalizer that runs as the signal comes
        signal.raise_signal(signal.SIGTERM)
        sum(range(1000))  # Python runs the handler here, inside __del__, which cannot raise


with Signals() as signals:
    try:
        Finalized()
        for _ in range(1000):  # start-up goes on
            sum(range(1000))
        print("start-up went on")
        signals.start_training()
        print("trained")
    except Stopped as e:
        print("stopped:", e)
"""


def test_a_start_up_signal_caught_inside_a_finalizer_still_stops_the_start_up():
    """A start-up signal whose handler ran inside a finalizer (a __del__: its Stopped cannot be raised there) stops
    the start-up at its next check, before the run directory is touched or training starts. Before, the Stopped
    was printed as an 'ignored error' and the run trained one step and stopped with a checkpoint: two lines that
    contradicted each other."""
    proc = subprocess.run([sys.executable, "-c", FINALIZER_SIGNAL], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": python_path()})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("start-up went on\nstopped: SIGTERM during start-up") and proc.stderr == "", proc


FINALIZER_INTERRUPT = r"""
import time
from lm.errors import _quiet_background_failures

_quiet_background_failures()


class Finalized:
    def __del__(self):  # as JAX's GC callback, when the Ctrl-C lands in it
        raise KeyboardInterrupt


try:
    Finalized()
    deadline = time.monotonic() + 60  # (a busy loop long enough for the interrupt to come on a loaded machine)
    while time.monotonic() < deadline:
        pass
    print("went on")
except KeyboardInterrupt:
    print("interrupted")
"""


def test_a_ctrl_c_inside_a_finalizer_still_interrupts():
    """(python -m lm.eval: a Ctrl-C that landed in JAX's GC callback was printed as an 'ignored error', and the
    evaluation ran to its end.)"""
    proc = subprocess.run([sys.executable, "-c", FINALIZER_INTERRUPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": python_path()})  # fmt: skip
    assert (proc.stdout, proc.stderr) == ("interrupted\n", ""), proc


FINALIZER_READ_ERROR = r"""
from lm.errors import _quiet_background_failures

_quiet_background_failures()


class Finalized:
    def __del__(self):  # as a read of a damaged step's arrays that failed in a background callback
        raise Exception("Encountered error while reading array index: (slice(0, 32, 1),). See full TensorStore "
                        "details: <bound method spec of TensorStore({\n  'base': {\n    'driver': 'zarr',\n})>")


Finalized()
"""


def test_a_damaged_steps_read_failing_in_the_background_is_one_warning_line():
    """A resume past a step whose array files were cut short: its reads that failed in TensorStore's callbacks were
    each printed as an 'ignored error' with TensorStore's whole spec, 60 lines apiece (180 lines for one step)."""
    proc = subprocess.run([sys.executable, "-c", FINALIZER_READ_ERROR], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": python_path()})  # fmt: skip
    assert proc.stderr == ("warning: ignored error in a background callback: Exception: Encountered error while "
                           "reading array index: (slice(0, 32, 1),).\n"), proc  # fmt: skip


# slow: about 13 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_signal_during_a_resumes_start_up_records_stopped(tmp_path, tiny_args):
    from lm import runs

    # A run that exists (here: finished 5 steps); resumed with a fresh data cache, so start-up prepares again (its
    # bpe:1000 the resume's by name: another is refused before anything is prepared).
    args = args_for(tiny_args, tmp_path / "run", "train.steps=5", "data.tokenizer=bpe:1000")
    first = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "tiny", *args], cwd=tmp_path,
                           capture_output=True, text=True)  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    assert runs.read_status(str(tmp_path / "run"))["status"] == "finished"
    wall = runs.summarize(str(tmp_path / "run")).wall_seconds
    code, _, err = _signal_during_prepare(tmp_path, signal.SIGTERM, "train.steps=10", "data.tokenizer=bpe:1000")
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert runs.read_status(str(tmp_path / "run"))["status"] == "stopped"
    assert runs.summarize(str(tmp_path / "run")).wall_seconds == wall  # (the start-up's seconds trained nothing)


def test_a_signal_during_the_restore_sets_no_checkpoint_aside(tmp_path, tiny_args, monkeypatch):
    """A SIGTERM or Ctrl-C while orbax restores the train state reaches the main thread in orbax's wait on its reads,
    which then fail as a damaged step's would ("Encountered error while reading array index ..."): the newest step,
    unharmed, was set aside as unreadable (a second signal set aside the next one, and the run was then refused)."""
    from lm.errors import Stopped

    cfg = config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", "train.steps=20", "train.ckpt_every=10"))
    train(cfg)
    restore = ckpt_lib.Checkpoints.restore

    def interrupted(self, *args, **kwargs):
        try:
            signal.raise_signal(signal.SIGTERM)  # lm's handler raises its Stopped here, as inside orbax's wait
        except BaseException as e:  # orbax's reads, cut short, fail as a damaged step's
            raise ValueError("Encountered error while reading array index: (slice(0, 32, 1),).") from e
        return restore(self, *args, **kwargs)

    monkeypatch.setattr(ckpt_lib.Checkpoints, "restore", interrupted)
    with pytest.raises(Stopped):
        train(config_lib.replace(cfg, train={"steps": 30}))
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["10", "20"]


def test_a_resume_with_another_validation_share_names_it(tmp_path, tiny_args):
    """data.val_fraction changed on resume was "the training data changed since checkpoint ... (token counts
    differ: its files, or how this lm encodes them, ...)": the files were as they were."""
    cfg = config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", "train.steps=10", "train.ckpt_every=10"))
    train(cfg)
    with pytest.raises(UserError, match=r"^data.val_fraction=0.2 holds out another part of the data for validation "
                       r"than 0.1, which checkpoint .*/checkpoints/10 was trained with; resume with "
                       r"data.val_fraction=0.1, or start"):  # fmt: skip
        train(config_lib.replace(cfg, train={"steps": 20}, data={"val_fraction": 0.2}))
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["10"]


# slow: about 8 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_resume_that_adds_drops_or_changes_data_val_path_names_it(tmp_path, tiny_args):
    """Each was "the training data changed since checkpoint ... (its files, or how this lm encodes them)": what
    changed is the validation data, which data.val_path takes out of data.path's held-out share."""
    (tmp_path / "a.txt").write_text("A held-out text of its own.\n" * 40)
    (tmp_path / "b.txt").write_text("Another held-out text.\n" * 40)
    steps = ["train.steps=2", "train.ckpt_every=2", "train.eval_every=0"]
    held_out = config_lib.load("tiny", args_for(tiny_args, tmp_path / "held_out", *steps))
    train(held_out)
    with pytest.raises(UserError, match=rf"^data.val_path={tmp_path}/a.txt makes the run train on all of its data, "
                       r"of which checkpoint .*held_out/checkpoints/2 held out data.val_fraction=0.1 for validation; "
                       r"resume without data.val_path, or start a new run from it: init_from=.*held_out/checkpoints/2 "
                       r"run.dir=NEW$"):  # fmt: skip
        train(config_lib.replace(held_out, train={"steps": 4}, data={"val_path": str(tmp_path / "a.txt")}))
    apart = config_lib.load("tiny", args_for(tiny_args, tmp_path / "apart", *steps, f"data.val_path={tmp_path}/a.txt"))
    train(apart)
    with pytest.raises(UserError, match=rf"^checkpoint .*apart/checkpoints/2 trained on all of its data, validating on "
                       rf"data.val_path={tmp_path}/a.txt, and without it this resume holds out data.val_fraction=0.1 "
                       rf"of the data; resume with data.val_path={tmp_path}/a.txt, or start"):  # fmt: skip
        train(config_lib.replace(apart, train={"steps": 4}, data={"val_path": ""}))
    with pytest.raises(UserError, match=rf"^data.val_path={tmp_path}/b.txt is not the validation data checkpoint "
                       rf".*apart/checkpoints/2 was trained beside \({tmp_path}/a.txt\), whose losses it goes on "
                       rf"from; resume with data.val_path={tmp_path}/a.txt, or start"):  # fmt: skip
        train(config_lib.replace(apart, train={"steps": 4}, data={"val_path": str(tmp_path / "b.txt")}))
    train(config_lib.replace(apart, train={"steps": 4}))  # (unchanged: it goes on)


def test_not_enough_disk_space_never_reads_as_enough(tmp_path, monkeypatch):
    """Sizes that round alike read "about 0.5 MiB needed, 0.5 MiB free": as much as needed, seemingly."""
    import types

    import numpy as np

    from lm import storage

    monkeypatch.setattr(storage, "free_bytes", lambda path: 500 << 10)
    state = {"w": np.zeros(110 << 10, np.float32)}  # 440 KiB, and a tenth more and 64 KiB: 548 KiB needed
    problem = ckpt_lib.Checkpoints._space_problem(types.SimpleNamespace(directory=str(tmp_path)), 10, state)
    assert "(about 0.54 MiB needed, 0.49 MiB free)" in problem, problem


def _evaluated_run(tmp_path, tiny_args):
    """A run with checkpoints (and validation losses) at steps 5 and 10."""
    more = ["train.steps=10", "train.ckpt_every=5", "train.eval_every=5", "train.keep=5", "logging.tensorboard=false"]
    train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", *more)))
    return tmp_path / "run"


def test_a_non_finite_validation_loss_is_never_the_best(tmp_path, tiny_args):
    """orbax sorts the steps by best_fn: a NaN validation loss sorted as it came, and --best chose the diverged step."""
    run = _evaluated_run(tmp_path, tiny_args)
    for step, loss in ((10, "NaN"), (5, "NaN"), (10, "Infinity")):
        for each in (5, 10):  # the other step's loss higher than any trained one's
            value = loss if each == step else "1000.0"
            (run / "checkpoints" / str(each) / "metrics" / "metrics").write_text(f'{{"val_loss": {value}}}')
        assert ckpt_lib.find(str(run), best=True)[1] == 15 - step  # the finite one


@pytest.mark.parametrize("text", ["{}", '{"val_loss": null}', '{"val_loss": "x"}'])
def test_a_validation_loss_file_of_json_without_a_loss_is_set_aside_not_a_traceback(tmp_path, tiny_args, text):
    """JSON that holds no validation loss passed orbax's reading, and failed as the steps were ranked: a traceback
    from `--best` (KeyError, TypeError), and a resume's first save failed."""
    run = _evaluated_run(tmp_path, tiny_args)
    metrics = run / "checkpoints" / "5" / "metrics" / "metrics"
    metrics.write_text(text)
    damaged = f"{metrics} (a checkpoint's validation loss) is damaged; move it away"
    with pytest.raises(UserError, match=re.escape(damaged)):
        ckpt_lib.find(str(run), best=True)
    ckpts = ckpt_lib.Checkpoints(str(run / "checkpoints"))  # as a resume opens them: set aside
    assert ckpts.best_step() == 10 and (metrics.parent / "metrics.unreadable").is_file()
    ckpts.close()


def test_a_non_finite_validation_loss_stops_the_run_before_its_checkpoint(tmp_path, tiny_args):
    """Finite weights whose logits overflow: the validation loss was NaN, the step saved and named the last good
    checkpoint, which the resume the message advised started from."""
    more = ["train.steps=6", "train.eval_every=1", "train.ckpt_every=1", "optim.lr=1e5", "optim.min_lr=1e5",
            "optim.warmup_steps=0", "optim.grad_clip=0", "logging.tensorboard=false"]  # fmt: skip
    with pytest.raises(UserError, match=r"^validation loss became nan at step 2 \(its parameters are finite\); last "
                                        r"good checkpoint: .*/checkpoints/1\. Lower optim\.lr"):  # fmt: skip
        train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", *more)))
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1"]


def test_an_incomplete_newest_step_is_warned_of_once(tmp_path, capsys):
    """A fine-tune finds its init_from's checkpoint several times (pinned, its config, its weights): the newest step
    that lacks an item is one warning, not one a look."""
    for step, items in ((10, ckpt_lib.READ), (20, ("tokenizer", "params"))):
        for item in items:
            (tmp_path / "checkpoints" / str(step) / item).mkdir(parents=True)
    for _ in range(3):
        assert ckpt_lib.find(str(tmp_path)) == (str(tmp_path / "checkpoints"), 10)
    assert capsys.readouterr().err.count("is incomplete (it has no config)") == 1


def test_best_reads_the_steps_again_where_the_rotation_deleted_one_meanwhile(tiny_run, monkeypatch):
    """--best (a read-only manager) while the run trains: orbax lists the steps, then stats each; a step the run's
    rotation deleted in between raised FileNotFoundError, read as "cannot use checkpoint directory ...: No such file
    or directory" (2 in ~1000 reads of a run saving every 5 steps). The listing is read again instead."""
    real, calls = ocp.CheckpointManager, []

    def racing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise FileNotFoundError(2, "No such file or directory", os.path.join(tiny_run, "checkpoints", "5"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ocp, "CheckpointManager", racing)
    assert ckpt_lib.find(tiny_run, best=True) == (os.path.join(tiny_run, "checkpoints"), 10)
    assert len(calls) == 2


def test_a_run_whose_rotation_deleted_steps_leaves_no_empty_pinned_directory(tmp_path, tiny_args):
    """The rotation locks each step it deletes with a file in RUN/pinned/ (readers' locks live there too): the files
    went, and the directory stayed behind, empty, in every run that rotated a step."""
    run_dir = train(config_lib.load("tiny", args_for(tiny_args, tmp_path / "run", "train.steps=6", "train.ckpt_every=2",
                                                     "train.keep=1", "train.eval_every=0")))  # fmt: skip
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["6"]
    assert "pinned" not in os.listdir(run_dir)


def test_the_rotation_deletes_the_lock_files_a_killed_run_left(tmp_path):
    """A run killed (kill -9) between its rotation's choice and the deletion left RUN/pinned/read-STEP.lock of a step
    that is gone; the resumed run's rotation deleted only its own lock files, so that one stayed for good (one more
    with every kill). A lock file a reader holds stays."""
    import types

    from orbax.checkpoint import checkpoint_managers as policies

    run = str(tmp_path)
    os.makedirs(os.path.join(run, "pinned"))
    open(ckpt_lib._reading_lock(run, 3), "w").close()  # the killed run's, of a step deleted since
    held = ckpt_lib.lock_file(ckpt_lib._reading_lock(run, 5), shared=True)  # a reader's
    rotation = ckpt_lib._Rotation(policies.LatestN(n=1), run)
    infos = [types.SimpleNamespace(step=s, metrics=None, time=None) for s in (4, 6)]
    assert rotation.should_preserve(infos, context=policies.PreservationContext()) == [False, True]
    rotation.release()  # (as the next save starts, step 4 deleted by then)
    assert os.listdir(os.path.join(run, "pinned")) == ["read-5.lock"]
    os.close(held)


def test_a_reader_is_not_refused_a_kept_step_while_another_process_deletes_its_unheld_lock_file(tmp_path):
    """A rotation (and a reader letting go) deletes each reading lock file no process holds, holding it exclusively
    for a moment first (_remove_unheld): a reader locking that step then was told the step was being deleted by the
    rotation (`--step N` refused, or a "waiting for the checkpoint" line), for a step that is kept."""
    import threading

    run = tmp_path / "run"
    step = run / "checkpoints" / "5"
    for item in ckpt_lib.READ:
        (step / item).mkdir(parents=True)
    (run / "pinned").mkdir()
    path = ckpt_lib._reading_lock(str(run), 5)
    remover = ckpt_lib.lock_file(path, shared=False)  # another process's _remove_unheld, between its lock and remove

    def finish():
        os.remove(path)
        os.close(remover)

    timer = threading.Timer(0.01, finish)
    timer.start()
    try:
        assert ckpt_lib.hold_for_reading(str(run / "checkpoints"), 5)
    finally:
        timer.join()
        ckpt_lib.release_reading()


def test_a_pin_of_a_run_deleted_and_started_again_from_another_model_is_let_go(tmp_path, tiny_args, capsys):
    """A LoRA run's pin kept its base step from the base run's rotation while the run was there; deleted and another
    run trained at its path (from scratch, or from another base), the pin kept the step for good, without the
    warning a pin of a run gone from its path gets. A run there that still starts from the step keeps it."""
    base, ft = str(tmp_path / "base"), str(tmp_path / "ft")
    os.makedirs(os.path.join(base, "checkpoints", "4"))
    ckpt_lib.pin(os.path.join(base, "checkpoints", "4"), ft)
    os.makedirs(ft)
    pinned = ckpt_lib._Pinned(base)

    def run_there(init_from):
        config_lib.save(config_lib.load("tiny", [f"init_from={init_from}"]), os.path.join(ft, "config.yaml"))

    run_there(os.path.join(base, "checkpoints", "4"))  # the LoRA run that pinned it
    assert [step for _, step, _ in pinned.pins()] == [4]
    os.makedirs(tmp_path / "other" / "checkpoints" / "2")
    for other in ("", str(tmp_path / "other" / "checkpoints" / "2"), "hf:/models/gpt2"):  # deleted, trained again
        run_there(other)
        assert pinned.pins() == []
    run_there(str(tmp_path / "moved" / "checkpoints" / "4"))  # its base moved since: kept (it cannot be told)
    assert [step for _, step, _ in pinned.pins()] == [4]
    run_there("")
    ckpt_lib.Checkpoints(os.path.join(base, "checkpoints"), keep=1).close()  # the base run trains on
    assert f"warning: step 4 is no longer kept for {ft}: the run there now starts from another model" \
        in capsys.readouterr().err
    assert not os.path.exists(os.path.join(base, "pinned")) or os.listdir(os.path.join(base, "pinned")) == []


def test_a_bpe_run_resumed_on_changed_text_says_so(tmp_path, tiny_args):
    """bpe:N trained again on inputs changed since the checkpoint: the resume said the data used "different
    tokenizers (both bpe:300 ...)" and to set data.tokenizer and data.path to match the checkpoint, which both did."""
    text = tmp_path / "small.txt"
    text.write_text(open(BUNDLED_CORPUS).read()[:20000])
    args = args_for(tiny_args, tmp_path / "run", "train.steps=2", "data.tokenizer=bpe:300", f"data.path={text}")
    train(config_lib.load("tiny", args))
    text.write_text(open(BUNDLED_CORPUS).read()[20000:40000])
    with pytest.raises(UserError, match=r"checkpoints/2 was trained with a bpe:300 tokenizer learned from other text "
                                        r"than the data holds now .* init_from=\S+checkpoints/2 run.dir=NEW"):
        train(config_lib.load(str(tmp_path / "run" / "config.yaml"), ["train.steps=4"]))
