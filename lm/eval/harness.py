"""The lm-evaluation-harness model class: EleutherAI's lm_eval scores our checkpoints with lm.eval's own scoring.

    pip install 'lm[eval]'
    python -m lm.eval.harness --model lm --model_args path=RUN_DIR --tasks hellaswag,arc_easy [lm_eval's options]
    python -m lm.eval.harness --model lm --model_args path=hf:DIR,batch_size=32,step=500 --tasks ...

    import lm.eval.harness, lm_eval                      # the import registers the model "lm"
    lm_eval.simple_evaluate(model="lm", model_args="path=runs/NAME", tasks=["arc_easy"])

model_args: path=RUN_DIR|hf:DIR (what lm.pretrained.load reads), batch_size (rows at once, 16; else lm_eval's own
--batch_size, whose default is 1; "auto" is taken as 16), step=N or best=true (which checkpoint of a run), and
max_gen_toks (the generation length when a task gives none, 256). lm_eval's --device is not used: JAX places the
weights over all local devices (lm.sharding.make_mesh). lm_eval's own console script cannot find a model outside
its package (it has no plugin hook), so python -m lm.eval.harness runs that command line after this module's
import has registered "lm".

The three request types, with lm.eval's machinery:
    loglikelihood          (context, continuation): tokenized as lm.eval.tasks does a choice (trailing whitespace
                           of the context moves to the continuation; the continuation's ids are those of context +
                           continuation after the context's; a document's choices together, as lm.eval.tasks
                           tokenizes a record's), truncated by lm.eval.scoring.fit, all requests in one
                           Scorer.score call: (log-likelihood, whether every token was the greedy one).
    loglikelihood_rolling  (text,): lm.eval.tasks.text_requests' disjoint windows (lm_eval's rolling windows), all
                           texts' windows in one Scorer.score call; a text's log-likelihood is their sum.
    generate_until         (context, gen_kwargs): lm.sampling.generate, greedy unless do_sample with a temperature
                           > 0; requests with the same gen_kwargs run batch_size at a time; the context's ids lose
                           their start to leave max_gen_toks of room in the window (as lm_eval's models do); the
                           text is cut before the first `until` string.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Any

try:
    import lm_eval.models  # lm_eval's own models first: its get_model imports them only into an empty registry
except ModuleNotFoundError as e:  # the extra not installed: the command says so in one line (a traceback, before)
    if __name__ != "__main__" or e.name != "lm_eval":
        raise
    print("error: python -m lm.eval.harness needs lm-evaluation-harness: pip install 'lm[eval]' (lm-eval 0.4.10 "
          "or later)", file=sys.stderr)  # fmt: skip
    sys.exit(2)
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from lm import sharding
from lm.config import MeshConfig, SampleConfig
from lm.errors import UserError, cli, first_line
from lm.eval.scoring import Scorer
from lm.eval.tasks import Example, choice_requests, text_requests
from lm.files import probe_writable
from lm.pretrained import checkpoint_source, load
from lm.sampling.loop import generate

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 16
DEFAULT_MAX_GEN_TOKS = 256
SAMPLING_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}  # what generate_until uses


def _int(name: str, value: Any, least: int, where: str = "model_args") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UserError(f"{where} {name}={value!r} must be an integer >= {least}")
    return value


class HarnessLM(LM):
    """An lm checkpoint (or hf:DIR) as an lm_eval model; see the module's docstring."""

    def __init__(
        self,
        path: str | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        step: int | None = None,
        best: bool = False,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        **unknown: Any,
    ):
        super().__init__()
        if unknown:
            raise UserError(
                f"unknown model_args {', '.join(sorted(unknown))}; the lm model takes path, batch_size, step, best, "
                "max_gen_toks"
            )
        if path is None or path == "":
            raise UserError("model_args needs path=RUN_DIR or path=hf:DIR (e.g. --model_args path=runs/NAME)")
        path = str(path)
        self.batch_size = _int("batch_size", batch_size, 1)
        self.max_gen_toks = _int("max_gen_toks", max_gen_toks, 1)
        if step is not None:
            step = _int("step", step, 0)
        if not isinstance(best, bool):
            raise UserError(f"model_args best={best!r} must be true or false")
        if step is not None and best:
            raise UserError("model_args step and best both choose a checkpoint; give one of them")
        self.source = checkpoint_source(path, step, best)
        mesh = sharding.make_mesh(MeshConfig())
        self.params, self.model_cfg, self.tokenizer = load(self.source, mesh=mesh)
        self.window = self.model_cfg.max_seq_len
        self.scorer = Scorer(self.params, self.model_cfg, self.batch_size, mesh=mesh, n_vocab=self.tokenizer.n_vocab)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> HarnessLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> HarnessLM:
        """lm_eval passes its --batch_size (default 1), --max_batch_size and --device beside model_args: a batch_size
        in model_args wins over lm_eval's, the others are not used."""
        args = dict(arg_dict)
        size = (additional_config or {}).get("batch_size")
        if "batch_size" not in args and size is not None:
            size = str(size)
            args["batch_size"] = int(size) if size.isdigit() else DEFAULT_BATCH_SIZE  # "auto", "auto:N": ours
        return cls(**args)

    # --- what lm_eval reads besides the requests -----------------------------------------------------------------

    @property
    def max_length(self) -> int:
        return self.window

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.spec

    def get_model_info(self) -> dict:
        return {"model_source": self.source, "tokenizer": self.tokenizer.spec, "max_length": self.window}

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm_eval's --apply_chat_template: the lm model scores the task's text as it is (lm_eval's base class raised
        NotImplementedError, a traceback, once the weights were read)."""
        raise UserError(NO_CHAT_TEMPLATE)

    # --- the requests ------------------------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        # The choices of one document (its requests with one context) are tokenized together, as lm.eval's: where a
        # choice's start merges into the context's last token, every choice is scored from the same token.
        groups: dict[tuple, list[int]] = {}
        for i, request in enumerate(requests):
            context, continuation = request.args
            if not continuation:  # log p(nothing) = 0, and nothing is trivially the greedy continuation
                results[i] = (0.0, True)
                continue
            doc = getattr(request, "doc_id", None)
            groups.setdefault((getattr(request, "task_name", None), doc, context), []).append(i)
        scored, order = [], []
        for (task, doc, context), members in groups.items():
            where = f"{task or 'request'} document {members[0] if doc is None else doc}"
            choices = tuple(requests[i].args[1] for i in members)
            scored += choice_requests(self.tokenizer, Example(where, context, choices, 0), self.window)
            order += members
        with tqdm(
            total=len(scored), desc="loglikelihood", unit="request", disable=disable_tqdm, file=sys.stderr
        ) as bar:
            for i, result in zip(order, self.scorer.score(scored, bar.update)):
                results[i] = result
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows = [text_requests(self.tokenizer, request.args[0], self.window) for request in requests]
        flat = [w for ws in windows for w in ws]
        with tqdm(
            total=len(flat), desc="loglikelihood_rolling", unit="window", disable=disable_tqdm, file=sys.stderr
        ) as bar:
            scores = self.scorer.score(flat, bar.update)
        results, at = [], 0
        for request, ws in zip(requests, windows):
            results.append(sum(lp for lp, _ in scores[at : at + len(ws)]))
            at += len(ws)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, results[-1])
        return results

    def _settings(self, gen_kwargs: dict) -> tuple[SampleConfig, list[str]]:
        """generate()'s settings and stop strings for a request's gen_kwargs (as lm_eval's hf model reads them)."""
        gen_kwargs = dict(gen_kwargs or {})
        unused = sorted(set(gen_kwargs) - SAMPLING_KWARGS)
        if unused:
            log.warning("gen_kwargs %s are not used by the lm model", ", ".join(unused))
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = _int("max_gen_toks", gen_kwargs.get("max_gen_toks", self.max_gen_toks), 1, "gen_kwargs")
        if max_new >= self.window:
            raise UserError(
                f"max_gen_toks={max_new} leaves no room for the prompt in the model's window of {self.window} tokens; "
                f"lower it (model_args max_gen_toks=N, or lm_eval's --gen_kwargs max_gen_toks=N)"
            )
        sample = bool(gen_kwargs.get("do_sample", False))
        temperature = float(gen_kwargs.get("temperature", 1.0)) if sample else 0.0
        settings = SampleConfig(max_new_tokens=max_new, temperature=temperature, top_k=0, top_p=1.0)
        if temperature > 0:
            top_p = gen_kwargs.get("top_p")  # (0: the most likely token alone, as transformers takes it; not off)
            top_k, top_p = int(gen_kwargs.get("top_k") or 0), 1.0 if top_p is None else float(top_p)
            settings = dataclasses.replace(settings, top_k=top_k, top_p=top_p)
        return settings, [s for s in until if s]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        results: list[str] = [""] * len(requests)
        with tqdm(
            total=len(requests), desc="generate_until", unit="request", disable=disable_tqdm, file=sys.stderr
        ) as bar:
            for members in groups.values():
                settings, stop = self._settings(requests[members[0]].args[1])
                room = self.window - settings.max_new_tokens
                prompts = {i: self.tokenizer.encode_context(requests[i].args[0]).tolist()[-room:] for i in members}
                members = sorted(members, key=lambda i: -len(prompts[i]))  # similar lengths share a batch's bucket
                for first in range(0, len(members), self.batch_size):
                    batch = members[first : first + self.batch_size]
                    chosen = [prompts[i] for i in batch]
                    samples = generate(
                        self.params, self.model_cfg, self.tokenizer, chosen, settings, seed=batch, stop=stop
                    )
                    for i, sample in zip(batch, samples):
                        results[i] = sample.text
                        self.cache_hook.add_partial("generate_until", requests[i].args, sample.text)
                    bar.update(len(batch))
        return results


if __name__ != "__main__":  # run as python -m, this file is __main__ and imports itself below to register once
    register_model("lm")(HarnessLM)


NO_CHAT_TEMPLATE = ("the lm model applies no chat template to lm_eval's prompts; drop --apply_chat_template (and "
                    "--fewshot_as_multiturn, --system_instruction's chat use)")  # fmt: skip


def _check_chat_template(argv: list[str]) -> None:
    """Refuse --apply_chat_template for the lm model before lm_eval reads its tasks (a download, which offline
    ended in that error's line instead of this one); lm_eval asks the model for it only once the data is in."""
    chat = any(a == "--apply_chat_template" or a.startswith("--apply_chat_template=") for a in argv)
    if _option(argv, "--model") == "lm" and chat:
        raise UserError(NO_CHAT_TEMPLATE)


def _option(argv: list[str], *names: str) -> str | None:
    """The value lm_eval's command line gives an option (`--name VALUE`, `--name=VALUE`; `names`: its spellings, the
    long one first)."""
    value = next((v for k, v in zip(argv, argv[1:]) if k in names), None)
    return next((a.split("=", 1)[1] for a in argv if a.startswith(names[0] + "=")), value)


def _check_output_path(argv: list[str]) -> None:
    """The directory of lm_eval's --output_path (-o) made and writable: the path itself, or a .json file's parent."""
    path = _option(argv, "--output_path", "-o")
    if not path:
        return
    directory = (os.path.dirname(path) if path.endswith(".json") else path) or "."
    try:
        probe_writable(directory)
    except OSError as e:
        raise UserError(
            f"cannot write lm_eval's results to {path}: {e.strerror or e}; give --output_path in a writable directory"
        ) from None


def _raised_in_lm_eval(e: BaseException) -> bool:
    """Whether lm_eval's own code raised `e` (its innermost frame is in the lm_eval package)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    package = os.path.dirname(lm_eval.__file__) + os.sep
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(package)


PROG = "python -m lm.eval.harness"
HELP_NOTE = (f"{PROG}: lm-eval's command line with lm's model registered; where lm-eval's help below says lm-eval, "
             f"type {PROG}, and give lm's model as --model lm --model_args path=RUN_DIR (or path=hf:DIR)")  # fmt: skip


def _one_line(parser: argparse.ArgumentParser, message: str) -> None:
    """lm_eval's parsers' mistakes (an unknown option, a bad value): one line naming this command, where argparse
    printed lm_eval's usage and then `lm-eval: error: ...`, naming lm_eval's own command, which has no model lm."""
    raise UserError(f"lm_eval: {message} (see {PROG} --help)")


@cli
def main(argv: list[str]) -> int:
    """lm_eval's command line, with the model "lm" registered (this module's import did that)."""
    from lm_eval.__main__ import cli_evaluate

    _check_output_path(argv)  # lm_eval finds it unwritable only once it has scored, and then only warns
    _check_chat_template(argv)
    if not argv or argv == ["run"] or {"-h", "--help"} & set(argv):  # lm_eval's help, which names its own command
        print(HELP_NOTE + "\n", flush=True)
    if len(argv) == 1 and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        # lm_eval runs `run` for options without a command only from two arguments on: `--model=lm` alone, or an
        # option's missing value (`--tasks`), was "unrecognized arguments"
        argv = ["run", *argv]
    saved, sys.argv = sys.argv, ["lm-eval", *argv]  # lm_eval's parser reads sys.argv
    error, argparse.ArgumentParser.error = argparse.ArgumentParser.error, _one_line  # (lm's own parsers: their own)
    try:
        cli_evaluate()
    except ValueError as e:
        if str(e).startswith("Tasks not found"):
            # (lm_eval 0.4.10+ lists them with `ls tasks`: its `--tasks list` is a task named "list", not found)
            raise UserError(f"lm_eval: {e}; see its task names with python -m lm.eval.harness ls tasks, or give a "
                            "task's YAML directory with --include_path DIR") from None  # fmt: skip
        if not _raised_in_lm_eval(e):
            raise
        # lm_eval's own checks of its options (no --tasks, --log_samples without --output_path, ...): raised as
        # ValueError, a traceback, where its parser's own mistakes are one line
        raise UserError(f"lm_eval: {first_line(e)}") from None
    except ModuleNotFoundError as e:  # lm_eval's other models' packages (--model hf needs accelerate and torch)
        raise UserError(f"lm_eval needs the {e.name} package for this: pip install {e.name} (lm's own model, "
                        "--model lm, needs none of lm_eval's extras)") from None  # fmt: skip
    except ConnectionError as e:  # a task's dataset from the Hugging Face Hub, unreachable (or offline mode)
        raise UserError(f"lm_eval could not download a task's data ({first_line(e)}); run where the Hugging Face Hub "
                        "is reachable, or give a local task with --include_path DIR") from None  # fmt: skip
    finally:
        sys.argv, argparse.ArgumentParser.error = saved, error
    return 0


if __name__ == "__main__":
    from lm.eval.harness import main as registered_main

    sys.exit(registered_main())
