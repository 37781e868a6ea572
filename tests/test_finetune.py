"""Fine-tuning: packed task examples with loss masks, starting points (our runs, Hugging Face GPT-2), LoRA."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util
from helpers import ROOT, assert_user_error, losses, run_cli, run_main

from lm import config as config_lib
from lm import checkpoint as ckpt_lib
from lm import lora, pretrained
from lm.checkpoint import complete_steps
from lm import data as data_lib
from lm.data import examples
from lm.data import prepare as prepare_lib
from lm.config import BUNDLED_CORPUS, ConfigError
from lm.errors import UserError
from lm.model import Transformer, count_params
from lm import train as train_lib
from lm.train import train
from lm.tokenizer import get_tokenizer, same_tokens

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "tiny_gpt2")


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, data_cache):
    """A tiny pretrained run (bytes tokenizer) to fine-tune from."""
    tmp = tmp_path_factory.mktemp("base")
    cfg = config_lib.load(
        "tiny",
        [f"run.dir={tmp / 'run'}", f"data.cache_dir={data_cache}", "logging.progress=false", "train.steps=20",
         "data.block_size=128"],
    )
    return train(cfg)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A small task file derived from the corpus by configs/make_finetune_example.py."""
    path = tmp_path_factory.mktemp("task") / "replies.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "configs", "make_finetune_example.py"), str(path)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    lines = path.read_text().splitlines()[:400]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# slow: about 10 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_the_example_data_scripts_take_help_and_refuse_mistakes_in_one_line(tmp_path):
    """make_finetune_example and make_preference_example took their first argument as the output, whatever it was:
    --help wrote a 0.9 MB file named --help (make_preference_example a directory), a second argument was ignored,
    and an output of the wrong kind (a directory for the JSONL file, a file for the directory) was a traceback."""
    (tmp_path / "data").mkdir()
    (tmp_path / "file.jsonl").write_text("")

    def run(script, *args):
        path = os.path.join(ROOT, "configs", f"{script}.py")
        return subprocess.run([sys.executable, path, *args], cwd=tmp_path, capture_output=True, text=True)

    for script in ("make_finetune_example", "make_preference_example"):
        shown = run(script, "--help")
        assert shown.returncode == 0 and shown.stdout.startswith("usage: "), shown.stderr
        extra = run(script, "a", "b")
        assert extra.returncode == 2 and extra.stderr.startswith("error: unrecognized arguments: b "), extra.stderr
    wrong = run("make_finetune_example", "data")
    assert wrong.returncode == 2 and wrong.stderr == (
        f"error: data is a directory; give the file to write, e.g. {os.path.join('data', 'replies.jsonl')}\n")
    wrong = run("make_preference_example", "file.jsonl")
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: file.jsonl is a file; "), wrong.stderr
    assert sorted(os.listdir(tmp_path)) == ["data", "file.jsonl"] and not os.listdir(tmp_path / "data")
    # Named as they were run (argparse said "see python make_finetune_example.py --help", a file not there).
    assert extra.stderr.endswith(f"(see python {os.path.join(ROOT, 'configs', 'make_preference_example.py')} --help)\n")
    for script in ("make_finetune_example", "make_cloze_task"):  # (make_cloze_task's mistakes were usage + error)
        module = subprocess.run([sys.executable, "-m", f"lm.configs.{script}", "--bogus"], cwd=tmp_path,
                                capture_output=True, text=True)  # fmt: skip
        assert module.returncode == 2 and module.stderr == (
            f"error: unrecognized arguments: --bogus (see python -m lm.configs.{script} --help)\n")


# slow: about 17 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_continued_pretraining_of_a_bpe_run_uses_its_tokenizer(tmp_path, monkeypatch):
    """data.tokenizer=bpe:N from a run trained with bpe:N, on other text: that text is prepared with the run's own
    ranks. (A BPE was trained anew on it, and the run refused as "init_from uses tokenizer bpe:300 but the data is
    tokenized with bpe:300", with no way out.) Its resume keeps them; a directory prepared with another bpe:300 is
    told apart by more than the name."""
    text = open(BUNDLED_CORPUS, encoding="utf-8").read()
    (tmp_path / "a.txt").write_text(text[:150_000], encoding="utf-8")
    (tmp_path / "b.txt").write_text(text[-150_000:], encoding="utf-8")
    common = [f"data.cache_dir={tmp_path / 'cache'}", "logging.progress=false", "data.tokenizer=bpe:300",
              "train.eval_every=0", "model.n_layer=1"]  # fmt: skip
    run = lambda name, *more: train(config_lib.load("tiny", [*common, f"run.dir={tmp_path / name}", *more]))
    base = run("base", f"data.path={tmp_path / 'a.txt'}", "train.steps=2")
    run("more", f"data.path={tmp_path / 'b.txt'}", f"init_from={base}", "train.steps=2")
    run("more", f"data.path={tmp_path / 'b.txt'}", f"init_from={base}", "train.steps=3")  # (the resume)
    base_tok, more_tok = (ckpt_lib.load_tokenizer(*ckpt_lib.find(str(tmp_path / r))) for r in ("base", "more"))
    assert more_tok.spec == "bpe:300" and same_tokens(more_tok, base_tok)
    prepared = lambda: sorted(os.listdir(tmp_path / "cache"))
    before = prepared()
    # Again on a.txt, whose bpe:300 directory is the base's tokens: read as it is (it was tokenized a second time,
    # into a directory named after the rank file); bpe:0300 is bpe:300 (a BPE was trained anew, then refused).
    run("again", f"data.path={tmp_path / 'a.txt'}", f"init_from={base}", "train.steps=1")
    run("spelled", f"data.path={tmp_path / 'b.txt'}", f"init_from={base}", "train.steps=1", "data.tokenizer=bpe:0300")
    assert prepared() == before
    # A run whose config holds bpe:0300 (as one written before 2026-12-02 does) continues with bpe:300, on text and
    # on examples alike.
    old = config_lib.load("tiny", [*common, f"run.dir={tmp_path / 'old'}", f"data.path={tmp_path / 'a.txt'}",
                                   "train.steps=1"])  # fmt: skip
    with monkeypatch.context() as before_2026_12_04:  # (prepare recorded the spelling given, not bpe:300)
        before_2026_12_04.setattr(prepare_lib, "spelled_once", lambda spec: spec)
        old_run = train(dataclasses.replace(old, data=dataclasses.replace(old.data, tokenizer="bpe:0300")))
    old_tok = ckpt_lib.load_tokenizer(*ckpt_lib.find(old_run))
    assert old_tok.spec == "bpe:0300"
    run("from-old", f"data.path={tmp_path / 'b.txt'}", f"init_from={old_run}", "train.steps=1")
    examples = dataclasses.replace(old, data=dataclasses.replace(old.data, format="examples", tokenizer="bpe:300"))
    train_lib._check_data_tokenizer(examples, old_tok, {"data.tokenizer"})  # (refused: "not init_from's bpe:0300")
    run("other", f"data.path={tmp_path / 'b.txt'}", "train.steps=1")  # (a bpe:300 of b.txt's own)
    b_dir = [d for d in os.listdir(tmp_path / "cache") if d.startswith("b-bpe_300")]
    with pytest.raises(UserError, match="both bpe:300, but trained on different text"):
        run("mixed", f"data.path={tmp_path / 'cache' / b_dir[0]}", f"init_from={base}", "train.steps=1")


def finetune_args(tmp_path, data_cache, base, task, *more):
    return [
        f"run.dir={tmp_path / 'ft'}",
        f"data.cache_dir={data_cache}",
        "logging.progress=false",
        f"init_from={base}",
        f"data.path={task}",
        "data.format=examples",
        "data.block_size=128",
        "data.batch_size=4",
        "train.steps=12",
        "train.log_every=1",
        "train.eval_every=6",
        "train.eval_batches=2",
        "train.ckpt_every=6",
        "optim.warmup_steps=2",
        *more,
    ]


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_finetune_from_our_run_inherits_the_model_and_learns_the_task(tmp_path, data_cache, base_run, task):
    # No model settings given: the architecture and tokenizer come from the checkpoint.
    cfg = config_lib.load(None, finetune_args(tmp_path, data_cache, base_run, task, "optim.lr=3e-3"))
    run_dir = train(cfg)
    saved = config_lib.load(os.path.join(run_dir, "config.yaml"))
    base = config_lib.load(os.path.join(base_run, "config.yaml"))
    started_from = os.path.join(os.path.abspath(base_run), "checkpoints", "20")  # the step it started from, pinned
    assert saved.model == base.model and saved.init_from == started_from
    evals = [r for r in rows(run_dir) if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 6, 12]  # step 0: the base model on the task
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    # Step 1 starts from the base model's parameters, not from a fresh initialisation.
    assert rows(run_dir)[1]["loss"] < 5.0


# slow: about 16 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_run_from_weights_chooses_scan_layers(tmp_path, data_cache, base_run, task):
    """model.scan_layers is a layout of the same weights: a fine-tune (full or LoRA) of an unscanned base may scan its
    layers (before, `init_from weights do not fit the requested model: model.scan_layers=True`), and scores the
    base as the unscanned fine-tune does; the LoRA run's merged weights load in its own layout."""
    short = ["train.steps=2", "train.eval_every=2", "train.ckpt_every=2", "optim.lr=1e-2"]
    step0 = {}
    for name, more in [("plain", []), ("scan", ["model.scan_layers=true"]),
                       ("lora", ["model.scan_layers=true", "lora.rank=4"])]:  # fmt: skip
        args = finetune_args(tmp_path, data_cache, base_run, task, *short, *more, f"run.dir={tmp_path / name}")
        run_dir = train(config_lib.load(None, args))
        assert config_lib.load(os.path.join(run_dir, "config.yaml")).model.scan_layers == bool(more)
        step0[name] = next(r["val_loss"] for r in rows(run_dir) if "val_loss" in r)
    assert step0["scan"] == pytest.approx(step0["plain"], rel=1e-6)
    assert step0["lora"] == pytest.approx(step0["plain"], rel=1e-6)
    params, cfg, _ = pretrained.load(str(tmp_path / "lora"))
    base, base_cfg, _ = pretrained.load(base_run)
    assert cfg.scan_layers and not base_cfg.scan_layers
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8) + 60
    merged = np.asarray(Transformer(cfg).apply(params, tokens))
    assert np.abs(merged - np.asarray(Transformer(base_cfg).apply(base, tokens))).max() > 1e-4  # the adapters act


# slow: two fine-tunes, one killed and resumed (about 35 s); test_checkpoint keeps resume exactness in the default suite; .ci/run runs it after the default suite, which keeps the default run within 15 minutes
@pytest.mark.slow
def test_finetune_resume_is_exact(tmp_path, data_cache, base_run, task):
    args = finetune_args(tmp_path, data_cache, base_run, task)
    whole = train(config_lib.load(None, [*args, f"run.dir={tmp_path / 'whole'}"]))
    cut = config_lib.load(None, [*args, f"run.dir={tmp_path / 'cut'}"])
    train(cut, stop_after=9)
    resumed = train(cut)
    keep = ("step", "loss", "grad_norm", "val_loss")
    same = lambda run: [{k: v for k, v in r.items() if k in keep} for r in rows(run)]
    assert same(whole) == same(resumed)
    ckptr = ocp.StandardCheckpointer()
    a = ckptr.restore(os.path.join(whole, "checkpoints", "12", "params"))
    b = ckptr.restore(os.path.join(resumed, "checkpoints", "12", "params"))
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_a_fine_tune_logs_its_epochs_and_resumes_them(tmp_path, data_cache, base_run, capsys):
    """metrics.jsonl's `epoch` and the "epoch N begins" lines count a fine-tune's packed rows, each epoch's own, as
    its stream gives them (README listed `epoch` for every run; a fine-tune logged none), on through a resume."""
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i}: ", "completion": f"A{i % 7}."}) + "\n" for i in range(40)))
    more = ["data.block_size=32", "train.steps=14", "train.eval_every=0", "train.ckpt_every=5"]
    args = finetune_args(tmp_path, data_cache, base_run, str(path), *more)
    whole = train(config_lib.load(None, [*args, f"run.dir={tmp_path / 'whole'}"]))
    out = capsys.readouterr().out
    # The stream's own epochs, batch by batch: an epoch's last batch is filled up with empty rows.
    cfg = config_lib.load(None, args)
    prepared = data_lib.prepare_for_training(cfg.data, cfg.seed, get_tokenizer("bytes"), progress=False)
    (source,) = prepared.sources
    counted, batches = [], []
    for epochs in (1, 2):
        stream = examples.example_iterator(source.directory, source.meta, 32, 4, cfg.seed, epochs, verbose=False)
        batches.append(sum(1 for _ in stream))
        stream = examples.example_iterator(source.directory, source.meta, 32, 4, cfg.seed, epochs, verbose=False)
        counted.append(sum(int(b["segment_ids"].any(axis=1).sum()) for b in stream))
    first, second = counted[0], counted[1] - counted[0]
    assert 2 <= batches[0] < batches[1] < 14
    begun = re.findall(r"^epoch (\d+) begins in step (\d+)$", out, re.M)
    assert begun[:2] == [("2", str(batches[0] + 1)), ("3", str(batches[1] + 1))]
    epochs = {r["step"]: r["epoch"] for r in rows(whole) if "epoch" in r}
    assert epochs[1] == pytest.approx(4 / first)
    assert epochs[batches[0]] == 1 and epochs[batches[1]] == 2
    assert epochs[batches[0] + 1] == pytest.approx(1 + 4 / second)
    cut = config_lib.load(None, [*args, f"run.dir={tmp_path / 'cut'}"])
    train(cut, stop_after=5)
    capsys.readouterr()
    resumed = train(cut)
    assert {r["step"]: r["epoch"] for r in rows(resumed) if "epoch" in r} == epochs
    assert re.findall(r"^epoch (\d+) begins in step (\d+)$", capsys.readouterr().out, re.M) == [
        b for b in begun if int(b[1]) > 5
    ]


# slow: two fine-tunes (about 30 s); .ci/run runs it after the default suite, which keeps the default run within 15 minutes
@pytest.mark.slow
def test_epochs_set_the_number_of_steps(tmp_path, data_cache, base_run, task):
    cfg = config_lib.load(None, finetune_args(tmp_path, data_cache, base_run, task, "data.epochs=1", "train.eval_every=0"))
    run_dir = train(cfg)
    steps = config_lib.load(os.path.join(run_dir, "config.yaml")).train.steps
    # 360 training examples of about 80 bytes, one or two to a 128-token row, 4 rows a batch.
    assert 40 <= steps <= 90 and rows(run_dir)[-1]["step"] == steps


def test_a_wsd_schedule_that_data_epochs_makes_impossible_names_data_epochs(tmp_path, data_cache, base_run, task):
    """data.epochs sets train.steps after the config is checked: the refusal said "raise train.steps", which
    data.epochs overrides, and it came after the run directory was made."""
    more = ["data.epochs=1", "optim.decay=wsd", "optim.decay_fraction=0.9", "optim.warmup_steps=30"]
    with pytest.raises(UserError, match=r"runs into the wsd decay.*or raise data.epochs=1, which sets train.steps$"):
        train(config_lib.load(None, finetune_args(tmp_path, data_cache, base_run, task, *more)))
    assert not (tmp_path / "ft").exists()


def test_lora_trains_only_adapters(tmp_path, data_cache, base_run, task, capsys):
    cfg = config_lib.load(
        None, finetune_args(tmp_path, data_cache, base_run, task, "lora.rank=4", "lora.targets=[qkv,fc]", "optim.lr=1e-2")
    )
    run_dir = train(cfg)
    out = capsys.readouterr().out
    assert re.search(r"^data: \d+ train and \d+ val examples, [\d,]+ train tokens \(", out, re.M)
    stored = ocp.StandardCheckpointer().restore(os.path.join(run_dir, "checkpoints", "12", "params"))
    names = {path[-1] for path in traverse_util.flatten_dict(stored)}
    assert names == {"a", "b"}  # adapters only: the base stays where init_from points
    assert any(np.abs(x).max() > 0 for path, x in traverse_util.flatten_dict(stored).items() if path[-1] == "b")
    base, model_cfg, _ = pretrained.load(base_run)
    merged, merged_cfg, _ = pretrained.load(run_dir)
    assert merged_cfg == model_cfg
    by_hand = lora.merge(base, jax.tree.map(np.asarray, stored), 16.0, 4)
    tokens = np.arange(16, dtype=np.int32)[None] % 200
    np.testing.assert_array_equal(
        Transformer(model_cfg).apply(merged, tokens), Transformer(model_cfg).apply(by_hand, tokens)
    )
    changed = [p for p, x in traverse_util.flatten_dict(merged).items() if not np.array_equal(x, traverse_util.flatten_dict(base)[p])]
    # The run line counts the adapters as what is trained, and the base model's size beside them.
    trained = sum(x.size for x in jax.tree.leaves(stored))
    assert f": {trained:,} trained parameters (LoRA adapters on {count_params(base) / 1e6:.2f}M), " in out
    assert changed and all(p[-2] in ("qkv", "fc") and p[-1] == "kernel" for p in changed)
    evals = [r for r in rows(run_dir) if "val_loss" in r]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    # The CLI samples from the merged model.
    proc = run_cli("sample.py", run_dir, "--prompt", "ROMEO:", "--max-new-tokens", "5", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr


def test_a_lora_run_loads_the_base_it_trained_on_in_its_param_dtype(tmp_path, data_cache, base_run, task):
    """model.param_dtype=bfloat16 on a float32 base: training merged the adapters onto the base rounded to
    bfloat16, and sample, eval and export merged them onto the float32 one, another model than the one trained
    and validated (logits 3e-3 apart on a tiny run)."""
    args = finetune_args(tmp_path, data_cache, base_run, task, "lora.rank=2", "model.param_dtype=bfloat16",
                         "optim.lr=1e-2", "train.steps=4", "train.eval_every=0")  # fmt: skip
    run_dir = train(config_lib.load(None, args))
    stored = ocp.StandardCheckpointer().restore(os.path.join(run_dir, "checkpoints", "4", "params"))
    base, _, _ = pretrained.load(base_run)
    trained_on = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), base)
    merged, model_cfg, _ = pretrained.load(run_dir)
    by_hand = lora.merge(trained_on, jax.tree.map(np.asarray, stored), 16.0, 2, model_cfg.dtype)
    assert jax.tree.all(jax.tree.map(lambda x, y: x.dtype == y.dtype and np.array_equal(x, y), merged, by_hand))


def test_a_lora_run_whose_base_moved_says_so(tmp_path, base_run, data_cache, task):
    """(Loading it named a path the user never gave, "RUN/checkpoints/N does not exist; give a run directory", not
    the LoRA run's base.)"""
    base = shutil.copytree(base_run, tmp_path / "base")
    args = finetune_args(tmp_path, data_cache, str(base), task, "lora.rank=2", "train.steps=2", "train.eval_every=0")
    run_dir = train(config_lib.load(None, args))
    shutil.move(base, tmp_path / "moved")
    with pytest.raises(UserError, match=rf"^the LoRA adapters of {run_dir}/checkpoints/2 were trained on "
                                        rf"init_from={base}/checkpoints/\d+, which is no longer there \(moved or "
                                        r"deleted\?\); put it back there"):  # fmt: skip
        pretrained.load(run_dir)


@pytest.mark.parametrize("mistake", [["lora.rank=33"], ["lora.rank=2", "lora.targets=[gate]"]])
def test_a_lora_mistake_found_in_the_weights_leaves_no_run_and_no_pin(tmp_path, base_run, data_cache, task, mistake):
    """A rank above a target's smaller side, or a target the model lacks, is refused before the run directory is
    touched: it left a failed run whose pin kept the base's step from the base run's rotation for good."""
    base = shutil.copytree(base_run, tmp_path / "base")
    args = finetune_args(tmp_path, data_cache, str(base), task, *mistake, "train.steps=2", "train.eval_every=0")
    with pytest.raises(UserError, match="smallest side of the weights|match no weights of this model"):
        train(config_lib.load(None, args))
    assert not os.path.exists(tmp_path / "ft")
    assert not [run for _, _, run in ckpt_lib._Pinned(str(base)).pins() if run == str(tmp_path / "ft")]


@pytest.mark.parametrize("lora_rank", [0, 2])
def test_a_resumed_fine_tune_rotates_the_step_it_resumed_from(tmp_path, base_run, data_cache, task, lora_rank):
    """The checkpoint a fine-tune (full or LoRA) resumed from was read as the run started (its config, tokenizer,
    sampling settings) and held from the rotation for as long as the run trained: train.keep=1 left it for good."""
    args = finetune_args(tmp_path, data_cache, base_run, task, f"lora.rank={lora_rank}", "train.eval_every=0",
                         "train.ckpt_every=2", "train.keep=1")  # fmt: skip
    run_dir = train(config_lib.load(None, [*args, "train.steps=2"]))
    train(config_lib.load(None, [*args, "train.steps=6"]))
    assert complete_steps(os.path.join(run_dir, "checkpoints")) == [6]


@pytest.mark.parametrize("how", ["stopped", "failed"])
def test_a_new_lora_run_that_ends_before_its_first_checkpoint_lets_go_of_its_base_step(
    tmp_path, data_cache, base_run, task, monkeypatch, how
):
    """A LoRA run pins its base's step as its run directory is made; one stopped by Ctrl-C while it builds its state
    or compiles (or that fails there) wrote no checkpoint, and nothing of it reads that step again. Before, its pin
    stayed: the step was kept from the base's rotation for good, and the base never named it (the run directory,
    with its config.yaml, is still there)."""

    def ends(*args, **kwargs):
        if how == "stopped":
            raise train_lib.Stopped("SIGINT", "SIGINT during start-up: stopped before training")
        raise UserError("failed during the first step")

    monkeypatch.setattr(train_lib, "_train", ends)
    args = finetune_args(tmp_path, data_cache, base_run, task, "lora.rank=2")
    with pytest.raises((train_lib.Stopped, UserError)):
        train(config_lib.load(None, args))
    ft = os.path.abspath(tmp_path / "ft")
    pins = os.path.join(base_run, "pinned")
    names = [n for n in os.listdir(pins) if n.endswith(".json")] if os.path.isdir(pins) else []
    assert not [n for n in names if json.load(open(os.path.join(pins, n)))["run"] == ft]


# slow: about 10 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_lora_run_without_its_base_step_says_which_it_reads(tmp_path, data_cache, task, capsys):
    """A LoRA run written before 2026-11-26 names its base run without the step (its step's config record holds
    init_from=RUN): readers read the base run's newest step, another model once the base trained on, silently.
    With more than one step there, they say so in one warning line naming the step read and how to pin one;
    followed literally, the pin reads the base the adapters were trained on."""

    def base_run(steps):
        args = [f"run.dir={tmp_path / 'base'}", f"data.cache_dir={data_cache}", "logging.progress=false",
                f"train.steps={steps}", "train.eval_every=0", "data.block_size=128", "train.ckpt_every=2"]  # fmt: skip
        return train(config_lib.load("tiny", args))

    base = base_run(2)
    args = finetune_args(tmp_path, data_cache, base, task, "lora.rank=2", "train.ckpt_every=2", "train.eval_every=0")
    run_dir = train(config_lib.load(None, [*args, "train.steps=2"]))
    before, _, _ = pretrained.load(run_dir)
    record = os.path.join(run_dir, "checkpoints", "2", "config", "metadata")
    with open(record) as f:
        item = json.load(f)
    with open(record, "w") as f:  # as written before: the base run's directory, no step, no fingerprint
        json.dump({**item, "init_from": base}, f)
    shutil.rmtree(os.path.join(run_dir, "checkpoints", "2", "base"))
    base_run(4)  # the base run trains on: its newest step is another model
    capsys.readouterr()
    pretrained.load(run_dir)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and f"reading its newest, {base}/checkpoints/4" in warnings[0], warnings
    pin = re.search(r"set init_from to (\S+)/STEP in (\S+)$", warnings[0])
    with open(pin[2], "w") as f:  # the advice, followed
        json.dump({**item, "init_from": f"{pin[1]}/2"}, f)
    after, _, _ = pretrained.load(run_dir)
    assert "warning" not in capsys.readouterr().err
    jax.tree.map(np.testing.assert_array_equal, after, before)


# slow: about 18 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_lora_run_keeps_the_base_step_it_started_from(tmp_path, data_cache, task, capsys):
    """init_from=RUN is pinned at the start to RUN's newest step (config.yaml holds that step's directory): when the
    base run trains on, the LoRA run's merged model (sample, export, eval) and its resume by the same command still
    read the base it was trained on. Before, they read RUN's newest checkpoint, another model of the same shape,
    silently. A resume from another model of the same shape is refused."""

    def base_run(name, steps, seed=0, keep=3):
        args = [f"run.dir={tmp_path / name}", f"data.cache_dir={data_cache}", "logging.progress=false",
                f"train.steps={steps}", "train.eval_every=0", "data.block_size=128", f"seed={seed}", f"train.keep={keep}"]  # fmt: skip
        return train(config_lib.load("tiny", args))

    base = base_run("base", 4)
    args = finetune_args(tmp_path, data_cache, base, task, "lora.rank=2", "train.ckpt_every=2", "train.eval_every=0")
    run_dir = train(config_lib.load(None, [*args, "train.steps=2"]))
    assert config_lib.load(os.path.join(run_dir, "config.yaml")).init_from == f"{base}/checkpoints/4"
    before, _, _ = pretrained.load(run_dir)
    base_run("base", 8, keep=1)  # the base run trains on: its newest checkpoint is now step 8, another model
    assert complete_steps(f"{base}/checkpoints") == [4, 8]  # step 4 kept from the rotation while the LoRA run exists
    after, _, _ = pretrained.load(run_dir)
    jax.tree.map(np.testing.assert_array_equal, after, before)
    train(config_lib.load(None, [*args, "train.steps=4"]))  # resumed by the same command
    assert config_lib.load(os.path.join(run_dir, "config.yaml")).init_from == f"{base}/checkpoints/4"
    # (alpha changes no array the checkpoint stores: the line said it did)
    with pytest.raises(UserError, match=r"settings that change how its adapters scale \(lora\.alpha 16\.0 vs "
                                        r"32\.0\)"):
        train(config_lib.load(None, [*args, "train.steps=6", "lora.alpha=32"]))  # the same adapters, another model
    other = base_run("other", 4, seed=1)
    with pytest.raises(UserError, match=r"this run was started from init_from=.*base/checkpoints/4, which its LoRA"):
        train(config_lib.load(None, [*finetune_args(tmp_path, data_cache, other, task, "lora.rank=2"), "train.steps=6"]))
    with pytest.raises(UserError, match=r"this run was started from init_from=.*base/checkpoints/4"):
        train(config_lib.load(None, [*finetune_args(tmp_path, data_cache, f"{base}/checkpoints/8", task, "lora.rank=2"),
                                     "train.steps=6"]))  # another step of the same base, named as such  # fmt: skip
    latest, _, _ = pretrained.load(run_dir)
    shutil.move(run_dir, tmp_path / "moved")  # moved (or deleted): the step is still kept, and the base says so
    capsys.readouterr()
    base_run("base", 10, keep=1)
    assert complete_steps(f"{base}/checkpoints") == [4, 10]
    (pin,) = [name for name in os.listdir(f"{base}/pinned") if name.endswith(".json")]  # (not a reader's lock)
    assert f"warning: step 4 is kept for {run_dir}, which is no longer there (moved or deleted?); delete " \
        f"{base}/pinned/{pin} to let the rotation remove it" in capsys.readouterr().err
    jax.tree.map(np.testing.assert_array_equal, pretrained.load(str(tmp_path / "moved"))[0], latest)
    ckpt_lib.release_reading()  # (this process read step 4 just now, which keeps it until then: lm.checkpoint.find)
    os.remove(f"{base}/pinned/{pin}")
    base_run("base", 12, keep=1)
    assert complete_steps(f"{base}/checkpoints") == [12]


@pytest.mark.parametrize("objective", ["lora", "dpo"])
# slow: about 19 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_base_changed_in_place_is_refused_at_resume_and_load(tmp_path, data_cache, task, objective):
    """A LoRA run reads its base, a DPO run its reference, again at every resume (and a LoRA run at every load):
    weights of the same shapes put where the base was (its run trained again from scratch, another model copied
    there) are refused in one line, by the fingerprint each checkpoint keeps of them. Before, the adapters were
    merged onto another model, and DPO resumed against another reference, silently."""

    def base_run(seed):
        args = [f"run.dir={tmp_path / 'base'}", f"data.cache_dir={data_cache}", "logging.progress=false",
                "train.steps=4", "train.eval_every=0", "data.block_size=128", f"seed={seed}"]  # fmt: skip
        return train(config_lib.load("tiny", args))

    base = base_run(0)
    if objective == "lora":
        more = ("lora.rank=2",)
    else:
        pairs = tmp_path / "pairs.jsonl"
        pairs.write_text("\n".join(json.dumps({"prompt": f"Q{i}: ", "chosen": "yes", "rejected": "no!"}) for i in range(16)))
        more = (f"data.path={pairs}", "data.format=preference", "train.objective=dpo")
    args = [*finetune_args(tmp_path, data_cache, base, task, "train.ckpt_every=2", "train.eval_every=0", *more)]
    run_dir = train(config_lib.load(None, [*args, "train.steps=2"]))
    if objective == "lora":
        pretrained.load(run_dir)  # the base it was trained on: loads
    shutil.rmtree(base)  # the base run deleted and trained again in its place
    base_run(1)  # the same shapes, other weights, at the same step
    says = r"the weights in \S*base/checkpoints/4 are not those .* \(params/\S+ differs and \d+ more tensors\); put those weights back"
    with pytest.raises(UserError, match=says):
        train(config_lib.load(None, [*args, "train.steps=4"]))
    if objective == "lora":
        with pytest.raises(UserError, match=says):
            pretrained.load(run_dir)
        assert_user_error(run_cli("sample.py", run_dir, "--prompt", "a", cwd=str(tmp_path)), "are not those the LoRA adapters")


def test_finetune_from_hugging_face_gpt2(tmp_path, data_cache, task):
    args = finetune_args(
        tmp_path, data_cache, f"hf:{FIXTURE}", task, "train.steps=3", "train.eval_every=3", "data.block_size=32"
    )
    run_dir = train(config_lib.load(None, args))
    saved = config_lib.load(os.path.join(run_dir, "config.yaml"))
    assert saved.model.n_layer == 2 and saved.model.vocab_size == 300 and saved.init_from == f"hf:{FIXTURE}"
    proc = run_cli("sample.py", run_dir, "--prompt", "ROMEO:", "--max-new-tokens", "5", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    # The run's config.yaml resumes it: it names the tokenizer the data was tokenized with (it named lm's default,
    # bytes, which the check of a chosen data.tokenizer refused as not init_from's)
    assert saved.data.tokenizer == "gpt2_hf"
    train(config_lib.load(os.path.join(run_dir, "config.yaml"), ["train.steps=4"]))
    assert max(r["step"] for r in losses(run_dir)) == 4


def test_finetune_bits_per_byte_are_of_the_text_the_loss_was_taken_on(tmp_path, data_cache, base_run, task, capsys):
    """val_bpb converts val_loss with the tokens and bytes it was taken on: the learned tokens of the batches
    evaluated, as cut to the window. (It used the whole split's counts, of uncut examples: 0.5% off in a chat run.)
    Its resume warns of the cut examples once."""
    import math

    from lm.data import prepare_for_training
    from lm.data.examples import count_truncated, example_val_batches

    args = finetune_args(tmp_path, data_cache, base_run, task, "data.block_size=32", "train.steps=2",
                         "train.eval_every=2", "train.ckpt_every=0")  # fmt: skip
    cfg = config_lib.load("tiny", args)
    row = [r for r in rows(train(cfg)) if "val_bpb" in r][-1]  # (step 2's; step 0's is the base's)
    data = prepare_for_training(cfg.data, cfg.seed, pretrained.config_and_tokenizer(base_run)[1], progress=False)
    (source,) = data.sources
    # (some are cut: the split's counts and the windows' differ)
    assert count_truncated(source.directory, source.meta, "val", 32)
    tokens = n_bytes = 0
    for batch in example_val_batches(source.directory, source.meta, 32, 4, 2, verbose=False):
        learned = batch["loss_mask"] > 0
        tokens, n_bytes = tokens + learned.sum(), n_bytes + data.tokenizer.byte_lengths[batch["targets"][learned]].sum()
    assert row["val_bpb"] == pytest.approx(row["val_loss"] / math.log(2) * tokens / n_bytes, rel=1e-6)
    # A resume warns of the cut examples once, as a new run does (it made the iterator twice, and said it twice).
    capsys.readouterr()
    train(config_lib.load("tiny", [*args, "train.steps=3"]))
    err = capsys.readouterr().err
    assert err.count("train examples are longer than block_size+1") == 1 and "random weights" not in err


def test_task_data_without_init_from_says_it_trains_from_random_weights(tmp_path, data_cache, task, capsys):
    """(configs/finetune_example.yaml run without its init_from trained a fresh model on the replies, silently.)"""
    args = [a for a in finetune_args(tmp_path, data_cache, "", task, "data.block_size=32", "train.steps=1",
                                     "train.eval_every=0", "train.ckpt_every=1") if a != "init_from="]  # fmt: skip
    train(config_lib.load("tiny", args))
    says = "warning: data.format=examples without init_from trains a model from random weights on this data alone; "
    assert says + "to fine-tune a trained model, add init_from=runs/NAME (or hf:DIR)\n" in capsys.readouterr().err
    train(config_lib.load("tiny", [*args, "train.steps=2"]))  # (its resume: said once, at the start)
    assert "random weights" not in capsys.readouterr().err


def test_finetune_errors(tmp_path, data_cache, base_run, task, monkeypatch, capsys):
    """(The first in a real process, the rest in this one: the same line and exit code.)"""
    proc = run_cli("train.py", *finetune_args(tmp_path, data_cache, base_run, task, "model.n_layer=5"), cwd=str(tmp_path))
    assert_user_error(proc, "init_from weights do not fit", "model.n_layer=5 (the weights have 2)")
    # What the user set counts, even where it equals the default (n_layer=4): never silently dropped.
    monkeypatch.chdir(tmp_path)
    four = finetune_args(tmp_path, data_cache, base_run, task, "model.n_layer=4")
    proc = run_main(train_lib.main, *four, capsys=capsys)
    assert_user_error(proc, "init_from weights do not fit", "model.n_layer=4 (the weights have 2)")
    text = finetune_args(tmp_path, data_cache, base_run, task, "data.format=text", "data.path=", "data.tokenizer=bpe:300")
    before = sorted(os.listdir(data_cache))
    assert_user_error(run_main(train_lib.main, *text, capsys=capsys), "init_from uses tokenizer bytes but "
                      "data.tokenizer is bpe:300; set data.tokenizer to match")  # fmt: skip
    assert sorted(os.listdir(data_cache)) == before  # (refused before a BPE is trained, or the text encoded with it)
    # Task data is tokenized with the starting model's tokenizer: another one chosen would do nothing.
    other = finetune_args(tmp_path, data_cache, base_run, task, "data.tokenizer=bpe:300")
    assert_user_error(run_main(train_lib.main, *other, capsys=capsys),
                      "data.tokenizer=bpe:300 is not init_from's tokenizer (bytes): data.format=examples is tokenized "
                      "with the starting model's own; set data.tokenizer=bytes (which overrides a preset's), or leave "
                      "data.tokenizer out")  # fmt: skip
    bad_target = finetune_args(tmp_path, data_cache, base_run, task, "lora.rank=2", "lora.targets=[qkvv]")
    assert_user_error(run_main(train_lib.main, *bad_target, capsys=capsys), "unknown LoRA target(s) qkvv")
    with pytest.raises(ConfigError, match="lora.rank > 0 adapts a trained model"):
        config_lib.load("tiny", ["lora.rank=4"])
    # A target no model has is the config's mistake, found as it is read: before the data is prepared.
    with pytest.raises(ConfigError, match=r"unknown LoRA target\(s\) foo; choose from qkv, q,"):
        config_lib.load("tiny", ["init_from=x", "lora.rank=4", "lora.targets=[qkv,foo]"])
    with pytest.raises(UserError, match="needs data.path"):
        train(config_lib.load("tiny", [f"data.cache_dir={data_cache}", "data.format=examples", f"run.dir={tmp_path}/x"]))


# slow: about 8 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_resume_with_another_seed_says_it_draws_another_validation_split(tmp_path, data_cache, base_run, task):
    """data.val_fraction holds out examples by the seed, so a resume with another seed would train on validation
    examples: refused, saying so (it said the data had changed, which it had not). With data.val_path the seed
    draws nothing of the data, and the resume goes on (a warning names the seed)."""
    short = ["train.steps=1", "train.ckpt_every=1", "train.eval_every=0"]
    args = finetune_args(tmp_path, data_cache, base_run, task, *short, "seed=1")
    train(config_lib.load(None, args))
    again = finetune_args(tmp_path, data_cache, base_run, task, *short, "seed=2", "train.steps=2")
    with pytest.raises(UserError, match=r"seed=2 holds out other examples for validation than seed=1, which checkpoint "
                       r".*/ft/checkpoints/1 was trained with \(data.val_fraction draws them by the seed\)"):  # fmt: skip
        train(config_lib.load(None, again))
    shutil.copy(task, tmp_path / "val.jsonl")  # (data.path itself as data.val_path is refused: a file of its own)
    held = [f"data.val_path={tmp_path / 'val.jsonl'}", f"run.dir={tmp_path / 'held'}"]
    train(config_lib.load(None, [*args, *held]))
    assert train(config_lib.load(None, [*again, *held])) == str(tmp_path / "held")


def test_a_resumed_lora_run_keeps_its_own_sampling_settings(tmp_path, data_cache, base_run, task):
    """A run reading its base again (LoRA) took the base's sample settings again at each resume, over those it was
    started with (a full fine-tune kept its own)."""
    short = ["train.steps=1", "train.ckpt_every=1", "train.eval_every=0", "lora.rank=2"]
    train(config_lib.load(None, finetune_args(tmp_path, data_cache, base_run, task, *short, "sample.temperature=0.9")))
    run_dir = train(config_lib.load(None, finetune_args(tmp_path, data_cache, base_run, task, *short, "train.steps=2")))
    assert config_lib.load(os.path.join(run_dir, "config.yaml")).sample.temperature == 0.9


@pytest.mark.parametrize("objective", ["lora", "dpo"])
def test_a_resume_whose_base_is_gone_says_so(tmp_path, data_cache, objective):
    """A LoRA run (or a DPO run) reads its hf: base again at every resume: with the base deleted, the resume said
    "DIR is not a directory; hf:DIR needs a Hugging Face model directory", as if the path had been mistyped."""
    base = tmp_path / "base"
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "open_models", "llama"), base)
    if objective == "lora":
        path = tmp_path / "task.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"Q{i}", "completion": f" A{i}"}) + "\n" for i in range(20)))
        more = ["data.format=examples", "lora.rank=2"]
    else:
        path = tmp_path / "pairs.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"Q{i}", "chosen": " yes", "rejected": " no"}) + "\n"
                                for i in range(20)))  # fmt: skip
        more = ["data.format=preference", "train.objective=dpo"]
    args = [f"init_from=hf:{base}", f"data.path={path}", f"data.cache_dir={data_cache}", f"run.dir={tmp_path / 'run'}",
            "data.block_size=32", "data.batch_size=4", "train.steps=4", "train.ckpt_every=2", "train.eval_every=0",
            "logging.progress=false",
            *more]  # fmt: skip
    train(config_lib.load(None, args), stop_after=2)
    shutil.rmtree(base)
    with pytest.raises(UserError, match=r"trained on init_from=hf:.*base, which is no longer there \(moved or deleted"):
        train(config_lib.load(None, args))
    assert complete_steps(os.path.join(tmp_path, "run", "checkpoints")) == [2]


def test_the_same_command_resuming_a_lora_run_whose_base_run_moved_says_so(tmp_path, data_cache, base_run, task):
    """The command that started it names the base run (init_from=runs/base; the run records its step): with that
    run moved, its resume said "runs/base does not exist; give a run directory", as if it were mistyped."""
    base = tmp_path / "base"
    shutil.copytree(base_run, base)
    args = finetune_args(tmp_path, data_cache, str(base), task, "lora.rank=2", "train.steps=4", "train.ckpt_every=2",
                         "train.eval_every=0")  # fmt: skip
    train(config_lib.load(None, args), stop_after=2)
    shutil.move(base, tmp_path / "moved")
    with pytest.raises(UserError, match=rf"^the LoRA adapters of .*ft were trained on init_from={base}/checkpoints/"
                       r"20, which is no longer there \(moved or deleted\?\); put it back there"):  # fmt: skip
        train(config_lib.load(None, args))
    assert complete_steps(os.path.join(tmp_path, "ft", "checkpoints")) == [2]


def test_a_fine_tunes_config_yaml_written_before_2026_12_02_resumes_it():
    """An lm before 2026-12-02 wrote lm's default (data.tokenizer: bytes) into a chat, task or preference
    fine-tune's config.yaml, though its data was tokenized with init_from's bpe:N: `train.py RUN/config.yaml`
    (README's resume) was refused as naming another tokenizer. The run's own record is no choice to refuse; another
    tokenizer than the run's record still is."""
    cfg = config_lib.load("tiny", ["data.format=chat", "data.path=chats.jsonl"])
    bpe = types.SimpleNamespace(spec="bpe:300")  # (init_from's tokenizer: the check reads its spec)
    with pytest.raises(UserError, match="data.tokenizer=bytes is not init_from's tokenizer"):
        train_lib._check_data_tokenizer(cfg, bpe, {"data.tokenizer"})
    train_lib._check_data_tokenizer(cfg, bpe, {"data.tokenizer"}, lambda: "bytes")  # (the run's own record)
    with pytest.raises(UserError, match="data.tokenizer=bytes is not init_from's tokenizer"):
        train_lib._check_data_tokenizer(cfg, bpe, {"data.tokenizer"}, lambda: "bpe:300")


# slow: about 11 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_fine_tune_checkpoint_of_another_cut_rule_is_refused_or_said(tmp_path, data_cache, base_run, capsys):
    """Examples longer than a row were cut at their end before 2026-11-27, and to keep their end (not their last
    learned token) until 2026-12-01: the prepared files are the same, so a checkpoint of then resumed on other rows
    and loss masks without a word. One without the dataset item's "stream" (before 2026-11-27) is refused; one
    without its "cut" rule, where chats that end in unlearned tokens are cut, is said."""
    chats = tmp_path / "chats.jsonl"
    chat = lambda i: {"messages": [{"role": "user", "content": f"Say {i} twice, please."},
                                   {"role": "assistant", "content": f"{i} and {i}, as you asked."}]}  # fmt: skip
    chats.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(40)))
    args = finetune_args(tmp_path, data_cache, base_run, str(chats), "data.format=chat", "data.block_size=16",
                         "train.ckpt_every=1", "train.eval_every=0")  # fmt: skip
    run = lambda steps: train(config_lib.load("tiny", [*args, f"train.steps={steps}"]))
    run_dir = run(2)

    def written_before(step, *keys):  # the step's dataset item as an older lm wrote it
        path = os.path.join(run_dir, "checkpoints", str(step), "dataset", "metadata")
        with open(path) as f:
            item = json.load(f)
        assert item[train_lib.CUT] == examples.CUT_RULE
        with open(path, "w") as f:
            json.dump({k: v for k, v in item.items() if k not in keys}, f)

    written_before(2, train_lib.CUT)
    capsys.readouterr()
    run(3)
    assert "records no cut rule" in capsys.readouterr().err
    run(4)  # (step 3 records it)
    assert "records no cut rule" not in capsys.readouterr().err
    written_before(4, train_lib.CUT, "stream")
    with pytest.raises(UserError, match="written by an lm before 2026-11-27, which cut examples longer than"):
        run(5)


# slow: about 16 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_pretraining_on_from_weights_takes_their_tokenizer_where_none_is_chosen(tmp_path, data_cache, base_run):
    """`train.py init_from=RUN data.path=TEXT` without a preset: data.tokenizer came from configs/default.yaml
    (bpe:1024), and a bytes model's run was refused as "init_from uses tokenizer bytes but the data is tokenized
    with bpe:1024", where the README says the settings not chosen come from the weights. One chosen still counts."""
    from lm import train as train_lib

    text = tmp_path / "more.txt"
    text.write_text("But soft, what light through yonder window breaks? " * 200)
    args = [f"init_from={base_run}", f"data.path={text}", f"data.cache_dir={data_cache}", "logging.progress=false",
            "train.steps=2", "train.eval_every=0", "data.block_size=64", "data.batch_size=4", "data.val_fraction=0.1"]
    assert train_lib.main([*args, f"run.dir={tmp_path / 'on'}"]) == 0
    assert config_lib.load(str(tmp_path / "on" / "config.yaml")).data.tokenizer == "bytes"
    # resumed by the same command, a LoRA run too (refused as another tokenizer, bpe:1024 by name, before the
    # weights' was taken)
    assert train_lib.main([*args, f"run.dir={tmp_path / 'on'}", "train.steps=4"]) == 0
    lora = [*args, f"run.dir={tmp_path / 'lora'}", "lora.rank=2", "train.ckpt_every=2"]
    assert train_lib.main(lora) == 0 and train_lib.main([*lora, "train.steps=4"]) == 0
    assert train_lib.main([*args, f"run.dir={tmp_path / 'other'}", "data.tokenizer=gpt2"]) == 2
