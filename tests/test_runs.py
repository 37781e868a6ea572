import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from lm import config as config_lib
from lm import runs
from lm.errors import UserError
from lm.metrics import MetricsWriter, read_metrics
from helpers import ROOT, run_cli, tensorboard_events, tensorboard_scalars

TINY = os.path.join(config_lib.CONFIG_DIR, "tiny.yaml")


def tiny_config(run_dir, *overrides):
    # A resolved config, as train.py writes it: the vocabulary and window filled in.
    return config_lib.load(
        TINY, [f"run.dir={run_dir}", "model.vocab_size=320", "model.max_seq_len=32", *overrides]
    )


def make_run(root, name, status=None, steps_done=20, ckpts=(10, 20), overrides=(), tasks=False):
    """A synthetic run directory: config.yaml, metrics.jsonl (train rows every 5 steps, val every 10, with
    two tasks' accuracy if `tasks`), checkpoints/<n>/ and, if given, status.json."""
    run_dir = os.path.join(root, name)
    os.makedirs(run_dir)
    cfg = tiny_config(run_dir, *overrides)
    config_lib.save(cfg, os.path.join(run_dir, "config.yaml"))
    tokens_per_step = cfg.data.batch_size * cfg.data.block_size
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step in range(5, steps_done + 1, 5):
            row = {"step": step, "loss": 5.0 - step / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens": step * tokens_per_step}
            f.write(json.dumps(row) + "\n")
            if step % 10 == 0:
                val = 4.0 - step / 20
                accuracy = {"acc/arc": step / 100, "acc_norm/arc": step / 50, "acc/piqa": 0.5} if tasks else {}
                row = {"step": step, "val_loss": val, "val_ppl": 2.0**val, "val_bpb": val / 2, **accuracy}
                f.write(json.dumps(row) + "\n")
    for step in ckpts:
        os.makedirs(os.path.join(run_dir, "checkpoints", str(step), "params"))
    if status is not None:
        with open(os.path.join(run_dir, runs.STATUS_FILE), "w") as f:
            json.dump(status, f)
    return run_dir


def ended(status, seconds, **extra):
    now = time.time()
    return {"status": status, "pid": 1, "host": socket.gethostname(), "started": now - seconds, "ended": now, **extra}


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid now names no process (until the system reuses it)
    return proc.pid


def by_name(root):
    return {r.name: r for r in runs.list_runs(root)}


def test_table_fields_and_every_status(tmp_path):
    root = str(tmp_path / "runs")
    here = socket.gethostname()
    now = time.time()
    make_run(root, "finished", ended("finished", 125.0, previous_seconds=60.0), tasks=True)
    # Written by this process (as track_status does): its pid, and a start after the process was created.
    make_run(root, "running", {"status": "running", "pid": os.getpid(), "host": here, "started": now})
    make_run(root, "killed", {"status": "running", "pid": dead_pid(), "host": here, "started": now - 30}, 15, (10,))
    # Our own pid, but "started" before this process existed: the pid was reused, the run is dead.
    make_run(root, "reused", {"status": "running", "pid": os.getpid(), "host": here, "started": 1000.0}, 10, (10,))
    make_run(root, "elsewhere", {"status": "running", "pid": 1, "host": here + "-other", "started": now - 5}, 10, ())
    make_run(root, "preempted", ended("preempted", 10.0), 10, (10,))
    make_run(root, "failed", ended("failed", 3.0, error="loss became nan at step 7"), 5, ())
    make_run(root, "stopped", ended("stopped", 3.0), 10, (10, 12))  # stopped at step 12, between logged steps
    make_run(root, "old-finished")  # no status.json: a checkpoint at train.steps means it finished
    make_run(root, "old-partial", steps_done=10, ckpts=(10,))
    os.makedirs(os.path.join(root, "not-a-run", "stuff"))

    table = by_name(root)
    assert sorted(table) == sorted(
        ["finished", "running", "killed", "reused", "elsewhere", "preempted", "failed", "stopped"]
        + ["old-finished", "old-partial"]
    )
    statuses = {name: r.status for name, r in table.items()}
    assert statuses == {
        "finished": "finished",
        "running": "running",
        "killed": "killed",
        "reused": "killed",
        "elsewhere": "running",  # another host's pid cannot be checked from here
        "preempted": "preempted",
        "failed": "failed",
        "stopped": "stopped",
        "old-finished": "finished",
        "old-partial": "unknown",
    }
    r = table["finished"]
    # configs/tiny.yaml, counted by hand: token and position tables, 2 blocks of
    # (2 LayerNorms, fused QKV, output projection, 4x MLP, all with biases), final LayerNorm.
    block = 2 * 64 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)
    assert r.params == 320 * 32 + 32 * 32 + 2 * block + 64 == 36736
    assert (r.step, r.steps, r.tokens) == (20, 20, 20 * 8 * 32)
    assert (r.best_val_loss, r.best_val_bpb, r.last_checkpoint) == (3.0, 1.5, 20)
    assert r.accuracy == {"arc": 0.2, "piqa": 0.5}  # the latest evaluation's
    assert table["killed"].accuracy == {}
    assert r.wall_seconds == pytest.approx(185.0)
    assert table["failed"].error == "loss became nan at step 7"
    assert (table["stopped"].step, table["stopped"].last_checkpoint) == (12, 12)  # it was 10, the last logged
    assert 0 <= table["running"].wall_seconds < 30
    assert table["old-finished"].wall_seconds is None

    text = runs.format_table(list(table.values()))
    lines = text.splitlines()
    assert lines[0].split() == list(runs.COLUMNS)
    finished_line = next(line for line in lines if line.startswith("finished "))
    assert finished_line.split() == [
        "finished", "36.7k", "5.12k", "20/20", "3.0000", "1.5000", "arc=0.200", "piqa=0.500", "20", "finished", "3m05s"
    ]
    killed_line = next(line for line in lines if line.startswith("killed "))
    assert killed_line.split()[6] == "-"


def test_a_count_just_under_a_unit_shows_in_the_unit_it_rounds_to():
    # 3905 steps of 256 tokens: 999,680 rounds to 1,000k, which is 1M, not "1e+03k"
    shown = {n: runs._human(n) for n in (999, 999_499, 999_680, 999_600_000, 12_345_678)}
    assert shown == {999: "999", 999_499: "999k", 999_680: "1M", 999_600_000: "1B", 12_345_678: "12.3M"}


def test_killed_wall_time_ends_at_the_last_metrics_write(tmp_path):
    now = time.time()
    run_dir = make_run(
        str(tmp_path), "k", {"status": "running", "pid": dead_pid(), "host": socket.gethostname(), "started": now - 100}
    )
    os.utime(os.path.join(run_dir, "metrics.jsonl"), (now - 40, now - 40))
    assert runs.summarize(run_dir).wall_seconds == pytest.approx(60.0, abs=1.0)


def test_a_stop_during_start_up_leaves_the_wall_time_as_it_was(tmp_path):
    """(A resume stopped during its start-up moved the last segment's end to that moment: the hours the run sat
    finished, or killed, counted as its wall time.)"""
    now = time.time()
    finished = make_run(str(tmp_path), "f", {"status": "finished", "started": now - 100, "ended": now - 90})
    killed = make_run(
        str(tmp_path), "k", {"status": "running", "pid": dead_pid(), "host": socket.gethostname(), "started": now - 100}
    )
    os.utime(os.path.join(killed, "metrics.jsonl"), (now - 40, now - 40))
    # A process on another host (a bucket's run resumed on a new machine): gone all the same, as the run's lock,
    # which the stopping command holds, says.
    away = {"status": "running", "pid": 1, "host": "another-host", "started": now - 100}
    elsewhere = make_run(str(tmp_path), "e", away)
    os.utime(os.path.join(elsewhere, "metrics.jsonl"), (now - 40, now - 40))
    for run_dir, seconds in ((finished, 10.0), (killed, 60.0), (elsewhere, 60.0)):
        runs.write_status(run_dir, "stopped", idle=True)
        assert runs.read_status(run_dir)["status"] == "stopped"
        assert runs.summarize(run_dir).wall_seconds == pytest.approx(seconds, abs=1.0)


def test_a_stop_inside_track_status_leaves_the_wall_time_as_it_was(tmp_path):
    """(A resume stopped while it restored its checkpoint or built its state, after track_status had begun its
    segment, added those seconds of start-up to the run's wall time, which the README says stays as it was.)"""
    from lm.errors import Stopped

    now = time.time()
    run_dir = make_run(str(tmp_path), "f", {"status": "finished", "started": now - 100, "ended": now - 90})
    with pytest.raises(Stopped), runs.track_status(run_dir):
        time.sleep(1.5)
        raise Stopped("SIGTERM", "SIGTERM during start-up")
    assert runs.read_status(run_dir)["status"] == "stopped"
    assert runs.summarize(run_dir).wall_seconds == pytest.approx(10.0, abs=0.5)


def test_track_status_records_each_ending(tmp_path):
    run_dir = str(tmp_path)
    with runs.track_status(run_dir) as outcome:
        status = runs.read_status(run_dir)
        assert status["status"] == "running" and status["pid"] == os.getpid()
        assert runs.effective_status(status) == "running"
    assert runs.read_status(run_dir)["status"] == "finished"
    assert outcome.status == "finished"
    first = runs.wall_seconds(runs.read_status(run_dir), run_dir)

    with runs.track_status(run_dir) as outcome:
        outcome.status = "preempted"
    status = runs.read_status(run_dir)
    assert status["status"] == "preempted"
    assert status["previous_seconds"] == pytest.approx(first)  # a resume adds up the segments

    with pytest.raises(UserError), runs.track_status(run_dir):
        raise UserError("loss became nan at step 3; lower optim.lr")
    status = runs.read_status(run_dir)
    assert (status["status"], status["error"]) == ("failed", "loss became nan at step 3; lower optim.lr")

    with pytest.raises(KeyboardInterrupt), runs.track_status(run_dir):
        raise KeyboardInterrupt
    status = runs.read_status(run_dir)
    assert status["status"] == "interrupted" and "error" not in status  # aborted by the user: not a failure

    with runs.track_status(run_dir):
        pass
    assert "error" not in runs.read_status(run_dir)  # a later success clears the old error
    assert os.listdir(run_dir) == [runs.STATUS_FILE]  # atomic writes leave no temporary files

    with runs.track_status(str(tmp_path / "absent"), enabled=False):
        pass  # other processes of a multi-host run write nothing
    assert not os.path.exists(tmp_path / "absent")


def test_a_run_that_fills_the_disk_still_records_how_it_ended(tmp_path, monkeypatch, capsys):
    """On a full disk status.json's atomic write (a new file) failed, and the run stayed "running" (read as
    "killed"); the old file's own space takes the record."""
    import errno

    run_dir = str(tmp_path)
    runs.write_status(run_dir, "running")

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runs, "write_json", full)
    message = "cannot write run/metrics.jsonl: No space left on device; free space, then run the same command to resume"
    with pytest.raises(UserError), runs.track_status(run_dir):
        raise UserError(message)
    status = runs.read_status(run_dir)
    assert (status["status"], status["error"]) == ("failed", message) and status["pid"] == os.getpid()
    assert os.listdir(run_dir) == [runs.STATUS_FILE] and capsys.readouterr().err == ""
    runs.write_status(str(tmp_path / "gone"), "stopped")  # no file to overwrite: a warning, no error
    assert f"warning: cannot write {tmp_path / 'gone' / runs.STATUS_FILE} (No space left on device)" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a file every write to fills the disk")
def test_a_metrics_write_on_a_full_disk_says_to_run_again_not_that_the_run_resumes(tmp_path):
    """(It said "then resume with the same command", of a run with no checkpoint to resume from, too.)"""
    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    writer.file.close()
    writer.file = open("/dev/full", "a")  # (each write: "No space left on device")
    with pytest.raises(UserError, match=r"metrics.jsonl \(No space left on device\); free disk space, then run the "
                                        r"same command again \(it resumes from the run's last checkpoint, if it has "
                                        r"one\)$"):  # fmt: skip
        writer.write({"step": 1, "loss": 1.0})
    with pytest.raises(OSError):  # (what it still holds, flushed to the same device)
        writer.file.close()


def test_write_status_rejects_unknown_status(tmp_path):
    with pytest.raises(ValueError, match="status must be one of"):
        runs.write_status(str(tmp_path), "done")


def test_cli_table_json_quiet_and_empty(tmp_path, capsys):
    root = str(tmp_path / "runs")
    make_run(root, "a", ended("finished", 5.0))
    make_run(root, "b", ended("failed", 1.0, error="boom"), 5, ())

    assert runs.main([root]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[0] == "name" and [line.split()[0] for line in out[1:]] == ["a", "b"]

    assert runs.main([root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["status"], r["error"]) for r in rows] == [("a", "finished", None), ("b", "failed", "boom")]
    assert rows[0]["tokens"] == 20 * 8 * 32 and rows[0]["last_checkpoint"] == 20

    assert runs.main([root, "--quiet"]) == 0
    assert capsys.readouterr().out.split() == [os.path.join(root, "a"), os.path.join(root, "b")]

    assert runs.main([os.path.join(root, "a")]) == 0  # one run directory
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["name", "a"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert runs.main([str(empty)]) == 0
    assert capsys.readouterr().out == f"no runs in {empty}/\n"
    assert runs.main([str(empty), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert runs.main([str(tmp_path / "missing")]) == 2  # a mistyped name: one line (no runs/ yet is "no runs")
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing'} does not exist; give a directory of runs " \
        "(runs) or one run's directory (runs/NAME)\n"
    assert runs.main([""]) == 2  # an unset shell variable: it listed the working directory as "no runs in "
    assert capsys.readouterr().err == "error: the directory of runs is empty ''; give a directory of runs (runs) " \
        "or one run's directory (runs/NAME), or leave it out for runs\n"


def test_no_runs_says_where_they_are_one_level_down_or_above(tmp_path, capsys, monkeypatch):
    """`lm.runs tmp` of tmp/runs/NAME, or `lm.runs RUN/checkpoints`, said only "no runs in ..."."""
    make_run(str(tmp_path / "runs"), "a", ended("finished", 5.0))
    (tmp_path / "runs" / "a" / "checkpoints").mkdir(exist_ok=True)
    (tmp_path / "notes").mkdir()
    monkeypatch.chdir(tmp_path)
    assert runs.main(["."]) == 0
    assert capsys.readouterr().out == "no runs in ./; ./runs holds runs: python -m lm.runs ./runs\n"
    assert runs.main(["runs/a/checkpoints"]) == 0
    assert capsys.readouterr().out == "no runs in runs/a/checkpoints/; it is a run's checkpoints: python -m lm.runs " \
        "runs/a\n"
    assert runs.main(["notes"]) == 0
    assert capsys.readouterr().out == "no runs in notes/\n"


def test_cli_default_root_in_a_subprocess(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lm.runs"],
        check=False,
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "no runs in runs/\n", "")


def test_unreadable_parts_leave_the_rest_of_the_row(tmp_path):
    run_dir = make_run(str(tmp_path), "r", ended("finished", 1.0))
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write("model:\n  no_such_key: 1\n")
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 25, "loss"')  # the writer was killed mid-line
    r = runs.summarize(run_dir)
    assert (r.params, r.steps, r.step, r.status) == (None, None, 20, "finished")
    assert runs.format_table([r]).splitlines()[1].split()[:4] == ["r", "-", "5.12k", "20/?"]


def as_permissions_say(argv: list[str]) -> list[str]:
    """argv run where file permissions hold: as root, which reads any directory, without the capabilities that let it
    (setpriv); skipped where root has no setpriv."""
    if os.geteuid() != 0:
        return argv
    if not shutil.which("setpriv"):
        pytest.skip("root reads any directory, and setpriv is not here to take that from it")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", *argv]


def test_a_run_that_cannot_be_read_is_left_out_with_a_warning(tmp_path):
    """(A run another user keeps private, or its checkpoints, made the whole table, sample.py's newest run and lm.plot
    a PermissionError traceback, or "has no metrics.jsonl".)"""
    root = tmp_path / "runs"
    make_run(str(root), "mine", ended("finished", 1.0))
    make_run(str(root), "closed", ended("finished", 1.0))
    theirs = make_run(str(root), "theirs", ended("finished", 1.0))
    os.chmod(theirs, 0)
    os.chmod(root / "closed" / "checkpoints", 0)
    run = lambda *argv: subprocess.run(as_permissions_say([sys.executable, *argv]), cwd=tmp_path, capture_output=True,
                                       text=True, timeout=120)  # fmt: skip
    try:
        table = run("-m", "lm.runs")
        newest = run("-c", "from lm import runs; print(runs.latest_run())")
        plot = run("-m", "lm.plot", "runs/theirs")
    finally:
        os.chmod(theirs, 0o755)
        os.chmod(root / "closed" / "checkpoints", 0o755)
    unreadable = "cannot list runs/{}: Permission denied; make it readable, or move it away"
    assert table.returncode == 0
    assert [line.split()[0] for line in table.stdout.splitlines()] == ["name", "closed", "mine"]
    assert table.stdout.splitlines()[1].split()[3] == "20/20"  # (its steps, from its metrics: no checkpoint)
    assert set(table.stderr.splitlines()) == {f"warning: {unreadable.format('theirs')} (left out)",
                                              f"warning: {unreadable.format('closed/checkpoints')} (the row shows no "
                                              "checkpoint)"}, table.stderr  # fmt: skip
    assert newest.returncode == 0 and newest.stdout == "runs/mine\n", newest.stderr
    assert f"warning: {unreadable.format('closed/checkpoints')} (that run is left out)" in newest.stderr.splitlines()
    assert plot.returncode == 2 and plot.stderr == f"error: {unreadable.format('theirs')}\n"


def test_the_table_counts_parameters_of_any_backends_run_and_none_of_an_empty_config(tmp_path):
    """A run trained with model.attention=cudnn, listed where no CUDA GPU is (a laptop, a bucket), was the whole
    table's error ("cannot be used here"); an empty config.yaml (the data's vocabulary, 0) an IndexError traceback."""
    gpu = runs.summarize(make_run(str(tmp_path), "gpu", ended("finished", 1.0), overrides=["model.attention=cudnn"]))
    assert gpu.params == runs.summarize(make_run(str(tmp_path), "cpu", ended("finished", 1.0))).params > 0
    empty = make_run(str(tmp_path), "empty", ended("finished", 1.0))
    open(os.path.join(empty, "config.yaml"), "w").close()
    assert (runs.summarize(empty).params, runs.summarize(empty).steps) == (None, None)  # (steps: the default's 2000)
    assert [r.name for r in runs.list_runs(str(tmp_path))] == ["cpu", "empty", "gpu"]


def test_damaged_metrics_lines_are_skipped_and_an_unreadable_file_is_one_line(tmp_path):
    """Bytes that are not UTF-8 and JSON that is not an object (a disk fault, a hand edit) are skipped like a line
    cut short, by lm.runs, lm.plot and a resume's truncation alike; a metrics.jsonl that is a directory is one line."""
    run_dir = make_run(str(tmp_path), "r", ended("finished", 1.0))
    with open(os.path.join(run_dir, "metrics.jsonl"), "ab") as f:
        f.write(b'\xff\xfe\x00garbage\n[1, 2]\n"text"\n{"loss": 9}\n{"step": 30, "loss": 1.5}\n')
    assert [row["step"] for row in read_metrics(run_dir)][-1] == 30
    assert all(isinstance(row, dict) for row in read_metrics(run_dir))
    assert runs.summarize(run_dir).step == 30
    MetricsWriter(run_dir, resume_step=30, tensorboard=False).close()  # keeps the rows up to step 30
    assert read_metrics(run_dir)[-1] == {"step": 30, "loss": 1.5}
    broken = make_run(str(tmp_path), "b", ended("finished", 1.0))
    os.remove(os.path.join(broken, "metrics.jsonl"))
    os.mkdir(os.path.join(broken, "metrics.jsonl"))
    with pytest.raises(UserError, match=r"cannot read .*metrics.jsonl: Is a directory"):
        read_metrics(broken)
    assert runs.summarize(broken).status == "finished"  # the rest of the row


class FakeRun:
    def __init__(self, **kwargs):
        self.init = kwargs
        self.logged = []
        self.finished = False
        self.exit_code = None

    def log(self, data, step):
        self.logged.append((step, dict(data)))

    def finish(self, exit_code=None):
        self.finished, self.exit_code = True, exit_code


class FakeWandb:
    """Stands in for the wandb package: records init arguments and logged scalars."""

    def __init__(self):
        self.runs = []

    def init(self, **kwargs):
        self.runs.append(FakeRun(**kwargs))
        return self.runs[-1]


def test_wandb_sink_logs_the_same_scalars_and_resumes_one_run(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run_dir = str(tmp_path / "myrun")
    os.makedirs(run_dir)
    config_text = config_lib.to_yaml(tiny_config(run_dir))
    w = MetricsWriter(run_dir, tensorboard=False, config_text=config_text, wandb=True, wandb_project="proj")
    w.write({"step": 5, "loss": 2.5, "lr": 1e-3, "tokens": 1280})
    w.write({"step": 10, "val_loss": 2.0, "val_bpb": 1.0, "acc/arc": 0.25, "acc_norm/arc": 0.5})
    w.close()
    first = fake.runs[0]
    assert first.init["project"] == "proj" and first.init["name"] == "myrun"
    assert first.init["resume"] == "allow" and first.init["dir"] == run_dir
    assert first.init["config"]["model"]["n_layer"] == 2
    assert first.logged == [
        (5, {"train/loss": 2.5, "train/lr": 1e-3, "train/tokens": 1280}),
        (10, {"val/val_loss": 2.0, "val/val_bpb": 1.0, "eval/acc/arc": 0.25, "eval/acc_norm/arc": 0.5}),
    ]
    assert first.finished
    assert [r["step"] for r in read_metrics(run_dir)] == [5, 10]

    # A resumed run continues the same W&B run.
    MetricsWriter(run_dir, resume_step=5, tensorboard=False, wandb=True).close()
    assert fake.runs[1].init["id"] == first.init["id"]
    assert fake.runs[1].init["project"] == "lm"
    # A fresh start (a run killed before its first checkpoint, started again) is a new W&B run: under the old id, W&B
    # kept the dead process's values at the steps the new one logs again.
    MetricsWriter(run_dir, tensorboard=False, wandb=True).close()
    assert fake.runs[2].init["id"] != first.init["id"]
    with open(os.path.join(run_dir, "wandb_id")) as f:
        assert f.read() == f"{fake.runs[2].init['id']}\n{os.path.realpath(run_dir)}\n"


def test_a_copied_run_is_a_new_wandb_run_and_a_moved_one_the_same(tmp_path, monkeypatch, capsys):
    """`cp -r runs/a runs/b`, then b resumed: b logged into a's W&B run, which dropped every step of b's up to a's
    last, without a word. A run moved (its first place gone) goes on in its W&B run, as does a run whose wandb_id
    an lm before 2026-12-06 wrote (the id alone)."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    a, b, c = (str(tmp_path / name) for name in "abc")
    os.makedirs(a)
    MetricsWriter(a, tensorboard=False, wandb=True).close()
    shutil.copytree(a, b)
    MetricsWriter(b, resume_step=5, tensorboard=False, wandb=True).close()
    assert fake.runs[1].init["id"] != fake.runs[0].init["id"]
    said = f"warning: {b} is a copy of {os.path.realpath(a)}, whose W&B run it would share; it is logged as a new W&B"
    said += " run"
    assert capsys.readouterr().err == said + "\n"
    MetricsWriter(b, resume_step=6, tensorboard=False, wandb=True).close()  # (the copy's own id from then on)
    assert fake.runs[2].init["id"] == fake.runs[1].init["id"] and capsys.readouterr().err == ""
    os.rename(a, c)
    MetricsWriter(c, resume_step=5, tensorboard=False, wandb=True).close()
    assert fake.runs[3].init["id"] == fake.runs[0].init["id"] and capsys.readouterr().err == ""
    (tmp_path / "c" / "wandb_id").write_text("0123abcd\n")  # (an older lm's file)
    MetricsWriter(c, resume_step=5, tensorboard=False, wandb=True).close()
    assert fake.runs[4].init["id"] == "0123abcd"


def test_a_run_reached_through_another_mount_is_the_same_wandb_run(tmp_path, monkeypatch, capsys):
    """A run directory seen at two places (a bind mount: a cluster's /scratch and /gpfs/scratch, a container's
    volume) has two real paths: resumed through the other, it was taken for a copy of itself, a new W&B run."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    a, mounted = tmp_path / "a", tmp_path / "mounted"
    a.mkdir(), mounted.mkdir()
    if subprocess.run(["mount", "--bind", str(a), str(mounted)], capture_output=True).returncode:
        pytest.skip("bind mounts need root here")
    try:
        MetricsWriter(str(a), tensorboard=False, wandb=True).close()
        MetricsWriter(str(mounted), resume_step=5, tensorboard=False, wandb=True).close()
        assert fake.runs[1].init["id"] == fake.runs[0].init["id"] and capsys.readouterr().err == ""
    finally:
        subprocess.run(["umount", str(mounted)], check=True)


def test_a_run_that_fails_is_a_failed_wandb_run_not_a_finished_one(tmp_path, tiny_args, monkeypatch):
    """A run that ended in an error (a loss gone NaN here) was finished with exit code 0: W&B showed it finished."""
    import importlib.machinery

    from lm.train import train

    fake = FakeWandb()
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # (what the check that it is installed finds)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = [*tiny_args, "logging.wandb=true", "train.steps=2", "train.eval_every=0"]
    with pytest.raises(UserError, match="loss became nan"):
        train(config_lib.load("tiny", [*args, "optim.lr=1e9", "optim.grad_clip=0"]))
    assert fake.runs[0].finished and fake.runs[0].exit_code == 1
    train(config_lib.load("tiny", [*args, f"run.dir={tmp_path / 'good'}"]))
    assert fake.runs[1].finished and fake.runs[1].exit_code == 0


def test_an_empty_wandb_id_gets_a_new_one(tmp_path, monkeypatch):
    """An empty RUN_DIR/wandb_id (its write cut short) was passed to W&B as the id of every resume, which refused it:
    "W&B did not start (Run ID cannot be empty); run `wandb login`", whatever the user did."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (tmp_path / "wandb_id").write_text("")
    MetricsWriter(str(tmp_path), resume_step=10, tensorboard=False, wandb=True).close()
    run_id = fake.runs[0].init["id"]
    assert run_id and (tmp_path / "wandb_id").read_text() == f"{run_id}\n{tmp_path.resolve()}\n"


def test_wandb_without_the_package_is_refused_before_the_run_exists(tmp_path, tiny_args, monkeypatch):
    """(It was refused at the metrics' start, after the run directory was made and marked failed.)"""
    from lm.errors import ConfigError
    from lm.train import train

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"logging.wandb=true needs the wandb package: pip install 'lm\[wandb\]'"):
        train(config_lib.load("tiny", [*tiny_args, "logging.wandb=true"]))
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("project", ["", "team/proj", "a:b", "x" * 129])
def test_a_project_name_wandb_refuses_is_refused_before_the_run_exists(tmp_path, tiny_args, project):
    """W&B refused these once the run directory was made (an empty one it took); now one line before."""
    from lm.errors import ConfigError
    from lm.train import train

    with pytest.raises(ConfigError, match=r"^logging.wandb_project=.* is no W&B project name: give 1 to 128 char"):
        train(config_lib.load("tiny", [*tiny_args, "logging.wandb=true", f"logging.wandb_project={project}"]))
    assert not os.path.exists(tmp_path / "run")


# slow: about 22 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_wandb_offline_in_a_real_run_and_quiet_silences_it(tmp_path, tiny_args):
    """The real wandb package, offline (no account, no network): the run writes its W&B run into RUN_DIR/wandb. With
    --quiet the terminal holds the run directory alone; W&B printed its ~35 lines of banner and summary there."""
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    done = run_cli("train.py", "tiny", *tiny_args, "train.steps=3", "optim.warmup_steps=1", "logging.wandb=true",
                   "--quiet", env=env)  # (warmup: no warning that 3 steps are all warmup)
    run_dir = os.path.join(tmp_path, "run")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (done.stdout, done.stderr) == (run_dir + "\n", "")
    with open(os.path.join(run_dir, "wandb_id")) as f:
        run_id = f.readline().strip()
    assert any(name.endswith(run_id) for name in os.listdir(os.path.join(run_dir, "wandb")))
    loud = run_cli("train.py", "tiny", *tiny_args, f"run.dir={tmp_path / 'loud'}", "train.steps=3", "logging.wandb=true",
                   env=env)  # fmt: skip
    assert loud.returncode == 0 and "wandb: " in loud.stderr  # (what quiet silences is there without it)


def test_wandb_missing_or_failing_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(UserError, match=r"^logging.wandb=true needs the wandb package: pip install 'lm\[wandb\]'"):
        MetricsWriter(str(tmp_path), tensorboard=False, wandb=True)
    assert not os.path.exists(tmp_path / "metrics.jsonl")

    class NoLogin(FakeWandb):
        def init(self, **kwargs):
            raise RuntimeError("api_key not configured (no-tty)\ncall wandb.login(key=...)")

    monkeypatch.setitem(sys.modules, "wandb", NoLogin())
    with pytest.raises(UserError, match=r"W&B did not start \(api_key not configured \(no-tty\)\); run `wandb login`"):
        MetricsWriter(str(tmp_path), tensorboard=False, wandb=True)


# slow: about 18 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_wandb_that_cannot_reach_its_server_ends_in_its_error_line(tmp_path, tiny_args):
    """The real wandb with a key and no server that answers: the run stops with the error as its output's last line
    (W&B printed a stray "wandb: " after it as the process exited, on stdout, below the error in a terminal)."""
    pytest.importorskip("wandb")
    with socket.socket() as s:  # a local port that nothing listens on: W&B's requests are refused at once
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = {"WANDB_API_KEY": "0" * 40, "WANDB_BASE_URL": url, "WANDB_INIT_TIMEOUT": "1", "WANDB_MODE": "online"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "tiny", *tiny_args, "logging.wandb=true"],
        env={**os.environ, **env}, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert proc.stdout.rstrip().splitlines()[-1].startswith("error: W&B did not start ("), proc.stdout[-2000:]


def test_tensorboard_holds_the_scalars_and_the_config_as_a_markdown_code_block(tmp_path):
    w = MetricsWriter(str(tmp_path), config_text="model:\n  n_layer: 2\n")
    w.write({"step": 1, "loss": 2.5, "val_loss": 3.0, "acc/arc": 0.25, "note": "not a number"})
    w.flush()  # on disk now, as at a checkpoint, before the writer is closed
    events = tensorboard_events(tmp_path)
    texts = [(v.tag, v.tensor.string_val[0].decode()) for e in events for v in e.summary.value if v.HasField("tensor")]
    assert texts == [("config/text_summary", "```\nmodel:\n  n_layer: 2\n\n```")]  # as SummaryWriter.add_text tags it
    scalars = {(e.step, v.tag): v.simple_value for e in events for v in e.summary.value if not v.HasField("tensor")}
    assert scalars == {(1, "train/loss"): 2.5, (1, "val/val_loss"): 3.0, (1, "eval/acc/arc"): 0.25}
    w.close()


def test_an_evaluations_point_reaches_tensorboard_at_once(tmp_path, monkeypatch):
    """An evaluation's row, written seconds after its step's row had flushed the file, waited in the buffer until the
    next logged step at least 5 s later: the validation curve lagged a logging interval behind the run."""
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    w = MetricsWriter(str(tmp_path))
    clock[0] = 10.0
    w.write({"step": 10, "loss": 2.0})  # 10 s since the start: flushed
    clock[0] = 11.0
    w.write({"step": 10, "val_loss": 1.9, "acc/arc": 0.5})
    assert tensorboard_scalars(tmp_path, "val/val_loss") == {10: pytest.approx(1.9)}
    w.write({"step": 11, "loss": 1.8})  # a step's row within 5 s of the last flush still waits for the next one
    assert tensorboard_scalars(tmp_path, "train/loss") == {10: 2.0}
    w.close()


def test_a_fresh_start_or_a_resume_shows_its_own_points_and_config_in_tensorboard(tmp_path, monkeypatch):
    """A run killed before its first checkpoint and started again (a fresh start, as metrics.jsonl is emptied) kept
    the dead process's points in TensorBoard; a resume with a changed config showed the first config only."""
    process = lambda pid: monkeypatch.setattr(os, "getpid", lambda: pid)  # (each one's event file, by name in order)
    process(111)
    killed = MetricsWriter(str(tmp_path), config_text="steps: 1000\n")
    for step in range(1, 6):
        killed.write({"step": step, "loss": 9.0})
    killed.flush()  # and never closed: killed outright
    process(222)
    again = MetricsWriter(str(tmp_path), config_text="steps: 3\n")
    for step in range(1, 4):
        again.write({"step": step, "loss": float(step)})
    again.close()
    assert tensorboard_scalars(tmp_path, "train/loss") == {1: 1.0, 2: 2.0, 3: 3.0}
    process(333)
    resumed = MetricsWriter(str(tmp_path), resume_step=2, config_text="steps: 4\n")
    resumed.write({"step": 3, "loss": 30.0})
    resumed.close()
    assert tensorboard_scalars(tmp_path, "train/loss") == {1: 1.0, 2: 2.0, 3: 30.0}
    texts = [(e.step, v.tensor.string_val[0].decode()) for e in tensorboard_events(tmp_path) for v in e.summary.value
             if v.HasField("tensor")]  # fmt: skip
    assert texts[1:] == [(0, "```\nsteps: 3\n\n```"), (3, "```\nsteps: 4\n\n```")]  # each start's, at its first step
    # A start that writes no TensorBoard file still drops the points it replaces: before, a resume from step 1 with
    # logging.tensorboard=false left step 2's and 3's, which TensorBoard showed as the run's (a fresh start, all)
    process(444)
    MetricsWriter(str(tmp_path), resume_step=1, tensorboard=False).close()
    assert tensorboard_scalars(tmp_path, "train/loss") == {1: 1.0}
    process(555)
    MetricsWriter(str(tmp_path), tensorboard=False).close()
    assert tensorboard_scalars(tmp_path, "train/loss") == {}


def test_the_best_validation_loss_is_the_best_finite_one(tmp_path):
    """A NaN evaluation made best_val_loss NaN (min() keeps a NaN it meets first), and --json wrote NaN, no JSON."""
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write('{"step": 10, "val_loss": NaN, "val_bpb": Infinity}\n{"step": 20, "val_loss": 4.19, "val_bpb": 2.0}\n')
    got = runs.summarize(str(tmp_path))
    assert (got.best_val_loss, got.best_val_bpb) == (4.19, 2.0)


def test_a_full_disk_under_tensorboard_warns_and_leaves_the_run_and_metrics_jsonl(tmp_path, monkeypatch, capsys):
    """TensorBoard's file failing (a full disk) stops that file with one warning; metrics.jsonl, whose own write
    reports a full disk as the run's error, keeps every record. (tensorboardX's writer thread died there, and its
    queue blocked training once full: the full-disk fault test hung.)"""
    from tensorboardX import record_writer

    w = MetricsWriter(str(tmp_path), tensorboard=True)

    def full_disk(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", full_disk)
    for i in range(1, 100):
        w.write({"step": i, "loss": 1.0})
    w.flush()
    w.close()
    assert len(read_metrics(str(tmp_path))) == 99
    assert capsys.readouterr().err == (
        "warning: TensorBoard's event file stopped (No space left on device); metrics.jsonl has every point\n"
    )


def test_a_run_whose_last_checkpoint_fails_to_write_is_a_failed_wandb_run(tiny_args, monkeypatch):
    """The last checkpoint's background write was waited for after W&B had finished the run with exit code 0: a run
    that then stopped on that failure (a full disk) showed as finished."""
    import importlib.machinery

    from lm import checkpoint
    from lm.train import train

    fake = FakeWandb()
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", fake)

    def wait(self):
        raise UserError("cannot write checkpoint 2: No space left on device")

    monkeypatch.setattr(checkpoint.Checkpoints, "wait", wait)
    args = [*tiny_args, "logging.wandb=true", "train.steps=2", "train.eval_every=0"]
    with pytest.raises(UserError, match="No space left"):
        train(config_lib.load("tiny", args))
    assert fake.runs[0].finished and fake.runs[0].exit_code == 1


def test_a_damaged_status_or_metrics_value_leaves_the_rest_of_the_table(tmp_path):
    """A status.json or metrics.jsonl value of another type (a hand-edited or damaged file) stopped the whole table in
    a TypeError traceback; its field is now left out of its own row, as an unreadable config.yaml's is."""
    here = socket.gethostname()
    make_run(str(tmp_path), "good", ended("finished", 1.0))
    make_run(str(tmp_path), "status", {"status": "running", "pid": 1, "host": here, "started": "yesterday"})
    make_run(str(tmp_path), "nopid", {"status": "running", "host": here, "started": time.time()})
    with open(os.path.join(make_run(str(tmp_path), "metrics", ended("finished", 1.0)), "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 25, "tokens": "many", "loss": 1.0, "acc/arc": None}) + "\n")
    found = by_name(str(tmp_path))
    assert (found["status"].status, found["status"].wall_seconds) == ("running", None)
    assert found["nopid"].status == "running"
    assert (found["metrics"].tokens, found["metrics"].step, found["metrics"].accuracy) == (5120, 25, {})
    assert len(runs.format_table(list(found.values())).splitlines()) == 5
