import json
import os
import re
import subprocess
import sys

import pytest

from lm import plot
from lm.errors import UserError

# matplotlib is in the test extra; this only spares an install without it the failures.
mpimg = pytest.importorskip("matplotlib.image")


def write_run(root, name, steps=40, eval_every=10, lr=1e-3, tasks=()):
    run_dir = os.path.join(root, name)
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step in range(5, steps + 1, 5):
            f.write(json.dumps({"step": step, "loss": 5 / step**0.5, "lr": lr * min(1, step / 10), "tokens": step * 256}))
            f.write("\n")
            if step % eval_every == 0:
                accuracy = {f"acc/{t}": step / 100 + i for i, t in enumerate(tasks)}
                f.write(json.dumps({"step": step, "val_loss": 5.5 / step**0.5, "val_bpb": 1.0, **accuracy}) + "\n")
    return run_dir


def test_plot_runs_writes_an_image_of_plot_size(tmp_path):
    a = write_run(str(tmp_path), "a")
    b = write_run(str(tmp_path), "b", steps=20, lr=3e-3)
    out = str(tmp_path / "curves.png")
    assert plot.plot_runs([a, b], out) == out
    height, width, _ = mpimg.imread(out).shape
    assert (width, height) == plot.SIZE


def drawn(monkeypatch, run_dirs, out):
    """The figure plot_runs saves."""
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: figures.append(self))
    plot.plot_runs(run_dirs, out)
    return figures[0]


def test_task_accuracy_gets_a_panel_of_its_own(tmp_path, monkeypatch):
    scored = write_run(str(tmp_path), "scored", tasks=("arc", "piqa"))
    plain = write_run(str(tmp_path), "plain")
    fig = drawn(monkeypatch, [scored, plain], str(tmp_path / "c.png"))
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss (nats/token)", "task accuracy", "learning rate"]
    lines = {line.get_label(): line for line in fig.axes[1].get_lines()}
    assert sorted(lines) == ["scored arc", "scored piqa"]  # the run without tasks draws none
    np = pytest.importorskip("numpy")
    np.testing.assert_allclose(lines["scored piqa"].get_ydata(), [1.1, 1.2, 1.3, 1.4])
    np.testing.assert_allclose(lines["scored arc"].get_xdata(), [10 * 256, 20 * 256, 30 * 256, 40 * 256])
    fig = drawn(monkeypatch, [plain], str(tmp_path / "d.png"))
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss (nats/token)", "learning rate"]


def test_a_run_of_one_logged_step_is_drawn(tmp_path, monkeypatch):
    """A run as long as train.log_every or shorter (a short fine-tune) logs one training row: its loss and learning
    rate were lines through one point, which draw nothing (its legend entry alone)."""
    short = write_run(str(tmp_path), "short", steps=5)
    fig = drawn(monkeypatch, [short], str(tmp_path / "c.png"))
    for ax in (fig.axes[0], fig.axes[-1]):
        (line,) = [line for line in ax.get_lines() if line.get_linestyle() == "-"]
        assert len(line.get_xdata()) == 1 and line.get_marker() not in ("None", "", None)
    longer = drawn(monkeypatch, [write_run(str(tmp_path), "longer")], str(tmp_path / "d.png"))
    assert longer.axes[0].get_lines()[0].get_marker() == "None"  # (lines of several points stay plain)


def test_a_run_that_has_logged_nothing_yet_is_left_out_not_refused(tmp_path, monkeypatch):
    """A run started (config.yaml, status.json) but before its first logged step has no metrics.jsonl yet: it was
    "has no metrics.jsonl; pass run directories (runs/NAME)", which it is, and stopped the plot of every run named."""
    logged = write_run(str(tmp_path), "logged")
    starting = tmp_path / "starting"
    starting.mkdir()
    (starting / "config.yaml").write_text("{}\n")
    (starting / "status.json").write_text('{"status": "running"}\n')
    fig = drawn(monkeypatch, [logged, str(starting)], str(tmp_path / "c.png"))
    assert {line.get_label() for line in fig.axes[0].get_lines()} == {"logged train", "logged val"}
    with pytest.raises(UserError, match="no training steps logged yet in .*starting; plot once a run has logged"):
        plot.plot_runs([str(starting)], str(tmp_path / "c.png"))


def test_every_run_of_more_than_ten_has_a_colour_of_its_own(tmp_path, monkeypatch):
    """Colours were C0..C9 over again: the 11th run was drawn as the 1st."""
    from matplotlib.colors import to_hex

    for n in (3, 11, 25):
        runs = [write_run(str(tmp_path / str(n)), f"r{i}") for i in range(n)]
        fig = drawn(monkeypatch, runs, str(tmp_path / "c.png"))
        train = [line for line in fig.axes[0].get_lines() if line.get_label().endswith(" train")]
        assert len({to_hex(line.get_color()) for line in train}) == n


def test_many_runs_are_named_once_each_beside_the_panels(tmp_path, monkeypatch):
    """Past a few runs, two legend entries a run inside the loss panel covered the curves, and past ten ran off the
    panel's bottom, unread. Each run is now named once, by its colour, right of the panels, with a key to the line
    styles; a few runs keep their entries in the panels."""
    runs = [write_run(str(tmp_path / "many"), f"r{i}", tasks=("arc",)) for i in range(12)]
    fig = drawn(monkeypatch, runs, str(tmp_path / "c.png"))
    assert all(ax.get_legend() is None for ax in fig.axes)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [f"r{i}" for i in range(12)] + [
        "train loss", "val loss", "arc accuracy"]  # fmt: skip
    few = drawn(monkeypatch, runs[:2], str(tmp_path / "d.png"))
    assert not few.legends and [t.get_text() for t in few.axes[0].get_legend().get_texts()] == [
        "r0 train", "r0 val", "r1 train", "r1 val"]  # fmt: skip


def test_same_names_in_different_directories_keep_their_paths(tmp_path):
    assert plot._labels(["x/run", "y/run", "z/other/"]) == ["x/run", "y/run", "other"]


def test_plot_mistakes_are_user_errors(tmp_path, monkeypatch):
    run = write_run(str(tmp_path), "a")
    with pytest.raises(UserError, match="nothing does not exist; pass run directories"):  # (not "has no metrics")
        plot.plot_runs([str(tmp_path / "nothing")], str(tmp_path / "c.png"))
    (tmp_path / "bare").mkdir()
    with pytest.raises(UserError, match="bare has no metrics.jsonl; pass run directories"):
        plot.plot_runs([str(tmp_path / "bare")], str(tmp_path / "c.png"))
    with pytest.raises(UserError, match=re.escape(f"run_dirs is a list of run directories, not one; write [{run!r}]")):
        plot.plot_runs(run, str(tmp_path / "c.png"))  # (one run, not in a list: "/ has no metrics.jsonl")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="no training steps logged yet"):
        plot.plot_runs([str(empty)], str(tmp_path / "c.png"))
    with pytest.raises(UserError, match="unknown image format; end the name in .png"):
        plot.plot_runs([run], str(tmp_path / "c.xyz"))
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"cannot write .*: \S+file is a file, not a directory; give a path in a wri"):
        plot.plot_runs([run], str(tmp_path / "file" / "c.png"))
    monkeypatch.setattr(plot, "available", lambda: False)
    says = r"^plotting needs matplotlib: pip install matplotlib \(or pip install 'lm\[plot\]'\)"
    with pytest.raises(UserError, match=says):
        plot.plot_runs([run], str(tmp_path / "c.png"))


def test_cli_quiet_and_errors(tmp_path, capsys):
    run = write_run(str(tmp_path), "a")
    out = str(tmp_path / "out.png")
    assert plot.main([run, "-o", out]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert plot.main([run, "-o", out, "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    assert plot.main([str(tmp_path / "missing")]) == 2
    assert "error:" in capsys.readouterr().err


def test_cli_names_an_empty_or_directory_output_and_draws_a_run_given_twice_once(tmp_path, capsys, monkeypatch):
    """-o DIR said "unknown image format" of a directory, -o '' "cannot write : ..."; a run given twice (runs/a and
    runs/a/, or two globs that overlap) was drawn twice, two curves of one colour each under its name."""
    run = write_run(str(tmp_path), "a")
    assert plot.main([run, "-o", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: -o {tmp_path} is a directory; give an image in it, e.g. " \
        f"{tmp_path / 'curves.png'}\n"
    assert plot.main([run, "-o", ""]) == 2
    assert capsys.readouterr().err.startswith("error: -o/--out is empty; give the image to write (curves.png")
    monkeypatch.chdir(run)  # (an unset "$RUN" inside a run plotted the working directory)
    assert plot.main(["", "-o", str(tmp_path / "y.png")]) == 2
    assert capsys.readouterr().err == "error: a run given is empty ''; give run directories (runs/NAME)\n"
    drawn = []
    monkeypatch.setattr(plot, "plot_runs", lambda run_dirs, out, shown: drawn.append(shown))
    other = write_run(str(tmp_path), "b")
    assert plot.main([run, other, run + "/", run, "-o", str(tmp_path / "x.png")]) == 0
    assert drawn == [[run, other]]


def test_an_image_goes_into_a_directory_made_for_it(tmp_path):
    """`-o plots/c.png` without plots/ said "No such file or directory" and nothing to do; lm.eval's --output
    makes its directory."""
    run = write_run(str(tmp_path), "a")
    out = tmp_path / "no" / "dir" / "c.png"
    assert plot.main([run, "-o", str(out), "-q"]) == 0
    assert mpimg.imread(str(out)).shape[:2] == (700, 1000)


def test_cli_in_a_subprocess_needs_no_display(tmp_path):
    run = write_run(str(tmp_path), "a")
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}
    proc = subprocess.run(
        [sys.executable, "-m", "lm.plot", run, "-o", "c.png", "-q"],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert (tmp_path / "c.png").stat().st_size > 0


def test_validation_points_sit_at_the_tokens_their_step_trained_on_across_a_batch_change():
    """(Validation and accuracy points were drawn at step x the last row's tokens per step, off the training curve
    of a run resumed with another batch size.)"""
    from lm.plot import _token_axis

    # 256 tokens a step to step 3, then 512 (a resume with twice the batch)
    at = _token_axis([{"step": 2, "tokens": 512}, {"step": 4, "tokens": 1280}, {"step": 6, "tokens": 2304}])
    assert [at(s) for s in (0, 1, 2, 4, 6, 7)] == [0, 256, 512, 1280, 2304, 2304 + 512]


def test_a_dpo_runs_loss_axis_says_it_is_per_pair(tmp_path, monkeypatch):
    """(A DPO run's own curves.png labelled its loss, -log sigmoid(margin) per pair, 'nats/token'.)"""
    dpo = write_run(str(tmp_path), "dpo")
    with open(os.path.join(dpo, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 45, "loss": 0.6, "lr": 1e-3, "tokens": 45 * 256, "reward_margin": 0.1}) + "\n")
    plain = write_run(str(tmp_path), "plain")
    assert drawn(monkeypatch, [dpo], str(tmp_path / "a.png")).axes[0].get_ylabel() == "DPO loss (nats/pair)"
    both = drawn(monkeypatch, [plain, dpo], str(tmp_path / "b.png")).axes[0].get_ylabel()
    assert both == "loss (nats/token; DPO: nats/pair)"
    assert drawn(monkeypatch, [plain], str(tmp_path / "c.png")).axes[0].get_ylabel() == "loss (nats/token)"


def plotted_through_a_pipe(run: str, pipe: str) -> bytes:
    """What lm.plot writes into a named pipe it is given, read as it is written."""
    import threading

    os.mkfifo(pipe)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(pipe, "rb").read()))
    reader.start()
    plot.plot_runs([run], pipe)
    reader.join(timeout=60)
    assert got, "nothing was read from the pipe"
    return got[0]


def test_an_image_written_to_a_pipe_or_a_link_goes_through_it(tmp_path):
    """`-o /dev/null` or `-o /dev/stdout` was renamed over: as root, /dev/null became a regular file. A device or
    a pipe is written into; a link to a file keeps its link, and the file it names gets the image."""
    run = write_run(str(tmp_path), "a")
    pipe = str(tmp_path / "pipe.png")
    assert plotted_through_a_pipe(run, pipe).startswith(b"\x89PNG") and not os.path.isfile(pipe)
    target = tmp_path / "images" / "latest.png"
    target.parent.mkdir()
    target.write_bytes(b"old")
    os.symlink(target, tmp_path / "link.png")
    plot.plot_runs([run], str(tmp_path / "link.png"))
    assert os.path.islink(tmp_path / "link.png") and target.read_bytes().startswith(b"\x89PNG")
    assert sorted(os.listdir(target.parent)) == ["latest.png"]


def test_an_image_written_to_a_device_or_pipe_without_a_suffix_is_a_png(tmp_path):
    """README: `-o /dev/stdout` is written into; it was refused ("unknown image format"), having no suffix. A device
    or a pipe without one gets PNG, as curves.png; a file without one is still refused."""
    run = write_run(str(tmp_path), "a")
    assert plotted_through_a_pipe(run, str(tmp_path / "pipe")).startswith(b"\x89PNG")
    plot.plot_runs([run], os.devnull)
    assert not os.path.isfile(os.devnull)
    with pytest.raises(UserError, match="unknown image format"):
        plot.plot_runs([run], str(tmp_path / "curves"))


def test_an_image_written_to_stdout_is_the_whole_of_stdout_piped_or_redirected_to_a_file(tmp_path):
    """`-o /dev/stdout | viewer` got "wrote /dev/stdout" after the PNG's last byte, in the image; `-o /dev/stdout >
    out.png` was refused ("unknown image format": /dev/stdout is then the regular file, without a suffix)."""
    run = write_run(str(tmp_path), "a")
    command = [sys.executable, "-m", "lm.plot", run, "-o", "/dev/stdout"]
    piped = subprocess.run(command, check=False, capture_output=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.startswith(b"\x89PNG") and piped.stdout.endswith(b"IEND\xaeB`\x82")
    assert piped.stderr == b"wrote /dev/stdout\n"
    with open(tmp_path / "out.png", "wb") as out:
        redirected = subprocess.run(command, check=False, stdout=out, stderr=subprocess.PIPE, timeout=120)
    assert (redirected.returncode, redirected.stderr) == (0, b"wrote /dev/stdout\n")
    assert mpimg.imread(tmp_path / "out.png").shape[:2] == (700, 1000)


def test_a_dollar_in_a_run_or_task_name_is_drawn_as_written(tmp_path, monkeypatch):
    """matplotlib takes text between two "$" for math: a run named 'cost $5 or $6' was labelled an italic 'cost
    5or6', and one named 'x $\\frac$ y' stopped the plot with a ParseSyntaxException traceback."""
    from matplotlib import cbook

    odd = [write_run(str(tmp_path), name, tasks=("t$1$",)) for name in ("cost $5 or $6", r"x $\frac$ y")]
    out = str(tmp_path / "c.png")
    assert plot.plot_runs(odd, out) == out  # (drawn: the math parsed at savefig)
    fig = drawn(monkeypatch, odd, out)
    texts = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert not any(cbook.is_math_text(t) for t in texts)
    assert [t.replace(r"\$", "$") for t in texts] == [
        "cost $5 or $6 train", "cost $5 or $6 val", r"x $\frac$ y train", r"x $\frac$ y val",
        "cost $5 or $6 t$1$", r"x $\frac$ y t$1$"]  # fmt: skip
