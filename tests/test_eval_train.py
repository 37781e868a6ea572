"""Task accuracy inside training (train.eval_tasks) and scoring over a device mesh."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, assert_user_error, run_cli, xla_flags

from lm import config as config_lib
from lm.train import train

TINY = os.path.join(config_lib.CONFIG_DIR, "tiny.yaml")
CORPUS = os.path.join(ROOT, "lm", "assets", "tinyshakespeare.txt")


def write_task(path, n, seed):
    """n four-way records cut from the corpus: the true continuation of a passage among three others."""
    import random

    rng = random.Random(seed)
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w") as f:
        for _ in range(n):
            at = rng.randrange(len(text) - 100)
            right = text[at + 40 : at + 52]
            choices = [right, *(text[b : b + rng.randrange(4, 20)] for b in rng.sample(range(len(text) - 20), 3))]
            rng.shuffle(choices)
            f.write(json.dumps({"context": text[at : at + 40], "choices": choices, "label": choices.index(right)}) + "\n")
    return str(path)


def lm_eval(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "lm.eval", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_tasks_are_scored_at_every_evaluation_as_lm_eval_scores_them(tmp_path, tiny_args):
    arc = write_task(tmp_path / "arc.jsonl", 12, 0)
    piqa = write_task(tmp_path / "piqa.jsonl", 30, 1)
    cfg = config_lib.load(
        TINY, [*tiny_args, "train.steps=20", f"train.eval_tasks=[{arc},{piqa}]", "train.eval_task_limit=10"]
    )
    run_dir = train(cfg)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "val_loss" in r]
    assert [r["step"] for r in evals] == [10, 20]
    for r in evals:
        assert {"acc/arc", "acc_norm/arc", "acc/piqa", "acc_norm/piqa"} <= set(r)
        assert all(r[k] * 10 == round(r[k] * 10) for k in r if k.startswith("acc"))  # 10 examples each
    # The same checkpoint, scored afterwards by the command line, on the same first 10 examples.
    out = tmp_path / "after.json"
    proc = lm_eval(run_dir, "--task", arc, "--task", piqa, "--limit", "10", "--output", str(out), "-q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = json.loads(out.read_text())["tasks"]
    for name in ("arc", "piqa"):
        assert after[name]["examples"] == 10
        assert after[name]["acc"] == evals[-1][f"acc/{name}"]
        assert after[name]["acc_norm"] == evals[-1][f"acc_norm/{name}"]


@pytest.mark.parametrize(
    "record, fragments",
    [
        (None, ("cannot read task file", "missing.jsonl")),
        ({"context": "a", "choices": ["b", "c"], "label": 2}, ("bad.jsonl:1", "label 2")),
        ({"context": "a", "choices": ["b", "c"]}, ("bad.jsonl:1", "label")),
    ],
    ids=["missing-file", "label-out-of-range", "no-label"],
)
def test_a_bad_task_stops_training_before_it_starts(tmp_path, tiny_args, record, fragments):
    path = tmp_path / ("missing.jsonl" if record is None else "bad.jsonl")
    if record is not None:
        path.write_text(json.dumps(record) + "\n")
    proc = run_cli("train.py", "tiny", *tiny_args, f"train.eval_tasks=[{path}]")
    assert_user_error(proc, *fragments)
    assert not os.path.exists(os.path.join(tmp_path, "run", "checkpoints"))


# slow: about 12 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_task_edited_between_a_run_and_its_resume_is_named(tmp_path, tiny_args, capsys):
    """(An edited task file, or another train.eval_task_limit, changed a resumed run's acc/NAME series silently; a
    task file deleted before the resume was a line with no fix.)"""
    task = write_task(tmp_path / "arc.jsonl", 4, 0)
    other = write_task(tmp_path / "piqa.jsonl", 4, 1)
    args = [*tiny_args, f"train.eval_tasks=[{task},{other}]", "train.eval_every=2"]
    run_dir = train(config_lib.load(TINY, [*args, "train.steps=2"]))
    write_task(tmp_path / "arc.jsonl", 4, 2)  # other examples under the same name
    capsys.readouterr()
    train(config_lib.load(TINY, [*args, "train.steps=4"]))
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: task")]
    assert len(warnings) == 1 and "task arc" in warnings[0] and "acc/arc after step 2 scores" in warnings[0], warnings
    capsys.readouterr()
    train(config_lib.load(TINY, [*args, "train.steps=6"]))  # unchanged since: nothing to say
    assert "warning: task" not in capsys.readouterr().err
    os.remove(task)
    proc = run_cli("train.py", "tiny", *args, "train.steps=8")
    assert_user_error(proc, f"cannot read task file {task}", "leave it out of train.eval_tasks")
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 6
    assert os.path.basename(run_dir) == "run"


# slow: about 8 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_two_tasks_of_one_name_are_refused(tmp_path, tiny_args):
    a = write_task(tmp_path / "task.jsonl", 2, 0)
    os.makedirs(tmp_path / "other")
    b = write_task(tmp_path / "other" / "task.jsonl", 2, 1)
    proc = run_cli("train.py", "tiny", *tiny_args, f"train.eval_tasks=[{a},{b}]")
    assert_user_error(proc, "named task")
    # One file named twice: "rename one" renamed both
    proc = run_cli("train.py", "tiny", *tiny_args, f"train.eval_tasks=[{a},{tmp_path}/./task.jsonl]")
    assert_user_error(proc, f"train.eval_tasks names {tmp_path}/task.jsonl twice; give it once")


def test_eval_task_limit_must_not_be_negative(tiny_args):
    with pytest.raises(config_lib.ConfigError, match="train.eval_task_limit"):
        config_lib.load(TINY, [*tiny_args, "train.eval_task_limit=-1"])


SCORE_ON_A_MESH = """
import json, sys
import flax.linen as nn, jax
from lm import config as config_lib, sharding
from lm.config import MeshConfig
from lm.eval.scoring import Scorer, fit
from lm.model import init_params
cfg = config_lib.resolve_model(config_lib.load("tiny").model, 256, 32)
mesh = sharding.make_mesh(MeshConfig(data=int(sys.argv[1]), tensor=int(sys.argv[2])))
boxed = init_params(cfg, jax.random.key(0))
params = jax.device_put(nn.unbox(boxed), sharding.param_shardings(boxed, mesh))
requests = [fit(list(range(1, 2 + i)), list(range(100, 103 + i % 5)), 32) for i in range(0, 40, 3)]
print(json.dumps([lp for lp, _ in Scorer(params, cfg, batch_size=5, mesh=mesh, n_vocab=256).score(requests)]))
"""


# slow: an 8-device process of its own (about 35 s); .ci/run runs it after the default suite, which keeps the default run within 15 minutes
@pytest.mark.slow
def test_scores_split_over_eight_devices_equal_one_devices():
    """Rows split over the data axis (and heads over tensor) change nothing but float rounding."""

    def scores(data, tensor):
        proc = subprocess.run(
            [sys.executable, "-c", SCORE_ON_A_MESH, str(data), str(tensor)],
            cwd=ROOT,
            env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(f"--xla_force_host_platform_device_count={data * tensor}")},  # host devices
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.splitlines()[-1])

    one = scores(1, 1)
    assert len(one) == 14 and len(set(one)) == 14
    assert scores(4, 2) == pytest.approx(one, rel=1e-5)


def test_a_resume_that_finds_a_task_edited_names_the_first_step_scored_anew(tmp_path, capsys):
    """The step a run resumes from was scored, and logged, with the old examples: the series changes after it (the
    line said "from step N on", N's own row being the old task's)."""
    from lm.eval.tasks import load_task
    from lm.train import _note_eval_tasks

    path = tmp_path / "t.jsonl"
    write_task(path, 4, 0)
    _note_eval_tasks(str(tmp_path), ((load_task(str(path), 0, ""), []),), 0)
    assert not capsys.readouterr().err
    write_task(path, 4, 1)
    _note_eval_tasks(str(tmp_path), ((load_task(str(path), 0, ""), []),), 6)
    assert "acc/t after step 6 scores the new ones" in capsys.readouterr().err
