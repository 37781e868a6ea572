"""lm.config: presets and overrides load into frozen dataclasses; every mistake is one clear line."""

from __future__ import annotations

import dataclasses
import glob
import os
import re

import pytest

from lm import config as C
from lm.validation import CHOICES
from lm.errors import UserError


def load_error(preset: str | None = None, overrides: list[str] = ()) -> str:
    with pytest.raises(C.ConfigError) as info:
        C.load(preset, list(overrides))
    message = str(info.value)
    assert message and "\n" not in message, f"not one line: {message!r}"
    return message


def write(tmp_path, text: str, name: str = "preset.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.rope_theta=20000"], "model.rope_theta=20000.0 applies only to model.pos=rope, and init_from's weights "
         "have model.pos=sinusoidal; drop model.rope_theta"),
        (["model.rope_scaling=linear", "model.rope_factor=2"], "model.rope_scaling=linear scales RoPE, and init_from's "
         "weights have model.pos=sinusoidal; drop model.rope_scaling and any other model.rope_* setting"),
    ],
)
def test_options_the_weights_positions_ignore_are_to_be_dropped(overrides, message):
    """A run from weights takes model.pos from them: RoPE's options on weights without RoPE were answered 'set
    model.pos=rope', which the weights then refused as another model."""
    cfg = C.load(None, ["init_from=x", *overrides])  # (then the weights' model: lm.train.resolve's second check)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pos="sinusoidal"))
    with pytest.raises(C.ConfigError) as info:
        C.validate(cfg, inherited=True)
    assert str(info.value) == message


def test_config_error_is_a_user_error():
    assert issubclass(C.ConfigError, UserError)


def test_defaults_load_and_validate():
    cfg = C.load()
    assert cfg == C.Config()
    assert cfg.format_version == C.FORMAT_VERSION


def test_other_trainers_names_are_not_lm_keys():
    leaves = {k.rsplit(".", 1)[-1] for k in C.all_keys()}
    assert not leaves & set(C.OTHER_NAMES) and set(C.OTHER_NAMES.values()) <= set(C.all_keys())


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.nlayer=3"], ["'model.nlayer'", "did you mean 'model.n_layer'"]),
        (["modle.n_layer=3"], ["'modle.n_layer'", "did you mean 'model.n_layer'"]),
        (["optim.learning_rate=1"], ["unknown config key 'optim.learning_rate'", "did you mean 'optim.lr'"]),
        # other trainers' names, which spelling alone led astray ("did you mean 'optim.lr'?", 'train.eval_batches')
        (["optim.clip_norm=1"], ["'optim.clip_norm'; did you mean 'optim.grad_clip'?"]),
        (["train.max_checkpoints=2"], ["'train.max_checkpoints'; did you mean 'train.keep'?"]),
        (["train.keep_checkpoints=2"], ["'train.keep_checkpoints'; did you mean 'train.keep'?"]),
        (["train.logging_steps=5"], ["'train.logging_steps'; did you mean 'train.log_every'?"]),  # not profile_steps
        (["logging.bars=false"], ["'logging.bars'; did you mean 'logging.progress'?"]),  # not logging.wandb
        (["model.hidden_size=64"], ["'model.hidden_size'; did you mean 'model.n_embd'?"]),
        (["optim.betas=1"], ["'optim.betas'; did you mean 'optim.b1'?"]),  # (optim.eps)
        (["optim.adam_epsilon=1"], ["'optim.adam_epsilon'; did you mean 'optim.eps'?"]),  # (optim.warmup_steps)
        (["optim.lr_scheduler_type=1"], ["'optim.lr_scheduler_type'; did you mean 'optim.decay'?"]),
        (["train.accumulate_grad_batches=2"], ["did you mean 'train.grad_accum'?"]),  # (train.eval_batches)
        (["model.d_ff=1"], ["'model.d_ff'; did you mean 'model.mlp_hidden'?"]),  # (model.head_dim)
        (["max_iters=1"], ["'max_iters'; did you mean 'train.steps'?"]),  # (format_version)
        (["model.n_layer=abc"], ["model.n_layer", "abc"]),
        (["optim.lr=fast"], ["optim.lr", "fast"]),
        (["model.bias=maybe"], ["model.bias", "maybe"]),
        (["model=3"], ["model"]),
        (["model.mlp=gelU"], ["model.mlp", "'gelU'", "did you mean 'gelu'"]),
        (["optim.decay=cosin"], ["optim.decay", "did you mean 'cosine'"]),
        (["model.dtype=bf16"], ["model.dtype", "bfloat16"]),
        (["model.n_embd=30", "model.n_head=4"], ["model.n_embd=30", "model.n_head=4", "divisible"]),
        (["model.n_head=4", "model.n_kv_head=3"], ["model.n_head=4", "model.n_kv_head=3", "divisible"]),
        (["model.n_embd=24", "model.n_head=8", "model.pos=rope"], ["rope", "even", "3"]),
        (["data.block_size=512", "model.max_seq_len=256"], ["data.block_size=512", "model.max_seq_len=256"]),
        (["optim.lr=0"], ["optim.lr must be a finite number > 0"]),
        (["optim.lr=-0.001"], ["optim.lr must be a finite number > 0"]),
        (["sample.temperature=inf"], ["sample.temperature must be >= 0 and at most 3.4e+38, got inf"]),
        (["data.batch_size=10", "train.grad_accum=3"], ["data.batch_size=10", "train.grad_accum=3"]),
        (["model.dropout=1.0"], ["model.dropout"]),
        (["mesh.fsdp=0"], ["mesh.fsdp"]),
        (["model.rope_scaling=llama3"], ["model.rope_scaling=llama3 scales RoPE", "model.pos=rope"]),
        (["model.pos=rope", "model.rope_scaling=yarn"], ["model.rope_scaling", "none, linear, llama3"]),
        (["model.pos=rope", "model.rope_scaling=linear", "model.rope_factor=0.5"], ["model.rope_factor must be a finite number >= 1"]),
        (["model.head_dim=-1"], ["model.head_dim must be >= 0"]),
        # options the model or the run would ignore (each trained exactly as without it)
        (["model.pos=rope", "model.rope_factor=8"], ["model.rope_factor=8.0 applies only to model.rope_scaling=linear (or llama3), and model.rope_scaling is none"]),
        (["model.pos=rope", "model.rope_scaling=linear", "model.rope_factor=2", "model.rope_original_max_len=16"],
         ["model.rope_original_max_len=16 applies only to model.rope_scaling=llama3, and model.rope_scaling is linear",
          "set model.rope_scaling=llama3 or drop model.rope_original_max_len"]),
        (["model.rope_theta=500000"], ["model.rope_theta=500000.0 applies only to model.pos=rope, and model.pos is learned"]),
        # (an RMSNorm has no bias: trained exactly as without it)
        (["model.norm=rmsnorm", "model.norm_bias=false"],
         ["model.norm_bias=false applies only to model.norm=layernorm, and model.norm is rmsnorm",
          "set model.norm=layernorm or drop model.norm_bias"]),
        (["lora.alpha=32"], ["lora.alpha=32.0 applies only to lora.rank >= 1, and lora.rank is 0", "set lora.rank >= 1 or drop lora.alpha"]),
        # (model.bias, the default, gives them already: each trained the same model; vocab_multiple a given size)
        (["model.qkv_bias=true"], ["model.qkv_bias=true applies only to model.bias=false, and model.bias is true"]),
        (["model.attn_bias=true"], ["model.attn_bias=true applies only to model.bias=false, and model.bias is true"]),
        (["model.bias=false", "model.attn_bias=true", "model.qkv_bias=true"],
         ["model.qkv_bias=true applies only to model.attn_bias=false, and model.attn_bias is true"]),
        (["model.vocab_size=300", "model.vocab_multiple=128"],
         ["model.vocab_multiple=128 pads an automatic model.vocab_size (0), and the config gives model.vocab_size=300, "
          "not a multiple of it; drop model.vocab_multiple, or give a model.vocab_size that is one"]),
        (["lora.targets=[fc]"], ["lora.targets=[fc] applies only to lora.rank >= 1"]),
        (["lora.targets=[[qkv]]"], ["lora.targets must be a list of strings, and one item is ['qkv']; write e.g. lora.targets=[a,b]"]),
        (["train.eval_tasks=[{path: a}]"], ["train.eval_tasks must be a list of strings, and one item is {'path': 'a'}"]),
        # (both were trained exactly as without them: issue found by a combination audit)
        (["optim.name=muon", "optim.weight_decay=0.5"], ["optim.weight_decay=0.5 sets the decay of the matrices AdamW trains, which with optim.name=muon are an untied head (model.tie_embeddings=false)", "here none; the Muon group's is optim.muon_weight_decay"]),
        (["optim.name=muon", "optim.weight_decay=0.5", "model.tie_embeddings=false", "lora.rank=4", "init_from=x"], ["a LoRA run trains only its adapters, which are Muon's: here none"]),
        (["optim.decay_embeddings=true", "lora.rank=4", "init_from=x"], ["optim.decay_embeddings=true applies only to lora.rank=0 (a LoRA run trains only its adapters), and lora.rank is 4"]),
        (["optim.decay_embeddings=true", "optim.weight_decay=0"], ["optim.decay_embeddings=true applies only to optim.weight_decay > 0"]),
        # (accepted and ignored: found by an audit of the recipes)
        (["optim.name=muon", "optim.muon_momentum=0", "optim.muon_nesterov=false"], ["optim.muon_nesterov=false applies only to optim.muon_momentum > 0"]),
        # (each was trained exactly as without it: found by an audit of the README's claims)
        (["train.eval_task_limit=5"], ["train.eval_task_limit=5 applies only to train.eval_tasks=[FILE.jsonl], and train.eval_tasks is []"]),
        (["train.keep_every=10", "train.ckpt_every=0"], ["train.keep_every=10 keeps the checkpoints at its multiples, but train.ckpt_every=0 writes only the final one"]),
        (["train.loss_chunk=-2"], ["train.loss_chunk must be >= 0", "0 = unchunked", "-1 to let the backend choose", "got -2"]),
        (["model.pos=rope", "model.head_dim=7"], ["even head dimension, got 7"]),
        (["data.epochs=2"], ["data.epochs counts passes over fine-tune examples", "set train.steps"]),
        (["model.n_layer"], ["key=value"]),
        (["=3"], ["no key"]),
        # run names that were no run: `..` trained into the current directory, `.` made runs/ one, a/b hid the run
        # from lm.runs and sample.py's newest; [x] wrote checkpoints whose arrays orbax (globbing its path) left out
        (["run.name=.."], ["run.name=.. is not a name: a run is runs/NAME", "or set run.dir to put the run elsewhere"]),
        (["run.name=a/b"], ["run.name=a/b is not a name"]),
        # (longer than a directory's name may be: "cannot write run directory ...; set run.dir to a writable one")
        ([f"run.name={'n' * 260}"], ["run.name is 260 bytes long, and a directory's name is at most 255"]),
        # (found by a fuzz of every key: a raw InterpolationKeyError traceback; a message naming no key; inf accepted
        # and an MFU of 0 logged, where every number of train.* is within float32's range)
        (["format_version=${oops}"], ["format_version is the version of the config format", "drop the override"]),
        (["lora.targets=${model.n_layer}"], ["bad value for 'lora.targets'", "lora.targets takes a list"]),
        (["train.eval_tasks=${seed}"], ["bad value for 'train.eval_tasks'"]),
        (["data.sources=${seed}"], ["bad value for 'data.sources'"]),
        (["train.peak_flops=inf"], ["train.peak_flops must be a finite number >= 0", "got inf"]),
    ],
)
def test_bad_overrides_raise_one_line(overrides, expected):
    message = load_error(None, overrides)
    for part in expected:
        assert part in message, (part, message)


def test_a_constant_schedule_takes_any_lr():
    """(min_lr, which a constant schedule never reaches, was checked against optim.lr: the tiny preset's 3e-4
    refused optim.lr=1e-4.)"""
    cfg = C.load("tiny", ["optim.decay=constant", "optim.lr=1e-4"])
    assert (cfg.optim.lr, cfg.optim.min_lr) == (1e-4, 3e-4)


def test_head_dim_frees_n_embd_from_n_head():
    cfg = C.load(None, ["model.n_embd=30", "model.n_head=4", "model.head_dim=8"])
    assert cfg.model.head_size == 8


def test_interpolations_resolve_and_a_literal_one_is_stored_as_such(tmp_path):
    """${...} is OmegaConf's interpolation, resolved at load; \\${x} is the text ${x}, which config.yaml and the
    checkpoint's stored config keep as text (the run could not be loaded again: "Interpolation key 'x' not found")."""
    cfg = C.load("tiny", [r"logging.wandb_project=\${x}", "run.name=${model.n_layer}L"])
    assert cfg.logging.wandb_project == "${x}" and cfg.run.name == f"{cfg.model.n_layer}L"
    C.save(cfg, str(tmp_path / "config.yaml"))
    assert C.load(str(tmp_path / "config.yaml")) == cfg
    assert C.from_dict(dataclasses.asdict(cfg)) == cfg


def test_a_literal_after_backslashes_is_stored_so_it_loads_back(tmp_path):
    """(OmegaConf reads \\\\${ as a backslash then an interpolation: the text team\\${x} was stored as team\\\\${x},
    and the run could not be loaded again.)"""
    for given, meant in [(r"team\\\${x}", "team\\${x}"), (r"c:\dir\${x}", "c:\\dir${x}"), (r"\${x}", "${x}")]:
        cfg = C.load(None, ["logging.wandb_project=" + given])
        assert cfg.logging.wandb_project == meant
        C.save(cfg, str(tmp_path / "config.yaml"))
        assert C.load(str(tmp_path / "config.yaml")).logging.wandb_project == meant


def test_yaml_merge_keys_tab_comments_and_no_alias_bombs(tmp_path):
    """The merge key << merges (it was refused: 'could not determine a constructor'), a tab before a comment is
    whitespace (PyYAML's pure-Python parser refused it), and aliases that refer to themselves or expand past any
    config's size are one line (nested aliases ran out of memory)."""
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "b.txt").write_text("b\n")
    merged = write(tmp_path, f"data:\n  sources:\n    - &src {{path: {tmp_path}/a.txt, weight: 2}}\n"
                             f"    - <<: *src\n      path: {tmp_path}/b.txt\ntrain:\n  steps: 7\t# a comment\n")
    cfg = C.load(merged)
    assert [(s.path, s.weight) for s in cfg.data.sources] == [(f"{tmp_path}/a.txt", 2), (f"{tmp_path}/b.txt", 2)]
    assert cfg.train.steps == 7
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdef", "bcdefg")
    ) + "train: {eval_tasks: *g}\n"
    assert "its aliases expand to more than 100,000 values" in load_error(write(tmp_path, bomb, "bomb.yaml"))
    assert "an alias refers to itself" in load_error(write(tmp_path, "train:\n  eval_tasks: &a [*a]\n", "self.yaml"))
    assert "key 'n_layer' is given twice" in load_error(write(tmp_path, "model:\n  n_layer: 2\n  n_layer: 3\n"))
    assert "key 'n_layer' is given twice" in load_error(write(tmp_path, "model:\n  <<: {n_layer: 3, n_layer: 4}\n"))
    assert "(a tab: YAML indents with spaces)" in load_error(write(tmp_path, "model:\n\tn_layer: 2\n"))
    assert "'model.n_layer' is an override's spelling" in load_error(write(tmp_path, "model.n_layer: 2\n"))  # (it said
    # "unknown config key 'model.n_layer'; did you mean 'model.n_layer'?")


def test_a_yaml_error_at_the_end_of_the_file_names_what_was_left_open(tmp_path):
    """An unclosed bracket or quote was found at the end of the file, and the line named was one past its last
    ("did not find expected ',' or ']' at line 4" of a 3-line file): the line where it was opened is named."""
    message = load_error(write(tmp_path, "model:\n  n_layer: 2\n  d_model: [32\n"))
    assert "at the end of the file: a flow sequence from line 3 is not closed" in message and "line 4" not in message
    assert "a quoted scalar from line 2 is not closed" in load_error(write(tmp_path, "model:\n  n_layer: \"2\n\n"))
    message = load_error(write(tmp_path, "model: {n_layer: 2\ntrain: {steps: 3}\n"))
    assert "at line 2 (in a flow mapping from line 1)" in message  # (where the parser stopped, and what it was in)
    assert load_error(write(tmp_path, "model:\n  n_layer: 2\n d_model: 3\n")).endswith("at line 3; fix the YAML there")


def test_integer_settings_beyond_their_range_and_configs_that_are_no_file_are_one_line(tmp_path):
    """(An OverflowError traceback from numpy or JAX, or a hang for model.n_layer=2**63; a directory or a pipe given
    as the config was 'not found'.)"""
    for override, message in [
        ("seed=9223372036854775808", "seed=9223372036854775808 is out of range: it must be in [-2**63, 2**63)"),
        ("model.n_layer=9223372036854775808", "model.n_layer=9223372036854775808 is out of range"),
        ("data.block_size=2147483648", "data.block_size=2147483648 is out of range: it must be in [-2**31, 2**31)"),
        ("data.shard_mb=inf", "data.shard_mb must be a finite number > 0"),
        ("optim.grad_clip=inf", "optim.grad_clip must be a finite number >= 0 (0 = off), got inf"),  # 0 is off
        # what training computes with is float32: 1e-44 is 0 there (a NaN loss blamed on optim.lr), 1e300 inf
        ("optim.eps=1e-44", "optim.eps=1e-44 is below float32's range, which training computes in (numbers of size "
                            "1.2e-38 to 3.4e+38; 0 aside); give one in it"),
        ("model.rope_theta=1e-50", "model.rope_theta=1e-50 is below float32's range"),
        ("optim.weight_decay=1e300", "optim.weight_decay=1e+300 is beyond float32's range"),
        ("train.peak_flops=1e-300", "train.peak_flops=1e-300 is below float32's range"),  # (MFU was inf in JSON)
        ("lora.alpha=-1e39", "lora.alpha must be a finite number > 0"),  # (each setting's own range first)
    ]:
        with pytest.raises(C.ConfigError, match=re.escape(message)):
            C.load("tiny", [override])
    with pytest.raises(C.ConfigError, match="is a directory, not a config file"):
        C.load(str(tmp_path))
    for fine in ("optim.eps=1.2e-38", "optim.weight_decay=0", "sample.temperature=1e-50", "data.val_fraction=1e-300"):
        C.load("tiny", [fine])  # float32's smallest normal number, 0, greedy, and the host's own numbers
    if os.path.exists("/dev/null"):
        with pytest.raises(C.ConfigError, match="config '/dev/null' is not a regular file"):
            C.load("/dev/null")


def test_a_config_made_in_python_is_checked_as_load_checks_one(tmp_path):
    """config.replace and train(cfg) from Python: a value of the wrong type was a TypeError from validation (or
    passed it, 2.5 layers, to fail in the model); an unknown field the dataclass's TypeError; a numpy integer an
    omegaconf error after the run directory was made (now read as the integer it holds). load took no pathlib.Path,
    None or a non-string override."""
    import pathlib

    import numpy as np

    from lm.train import train

    base = C.load("tiny", [f"run.dir={tmp_path / 'run'}", "train.steps=2"])
    assert C.typed(base) == base and C.typed(C.replace(base, model={"n_layer": "3"})).model.n_layer == 3
    # numpy's scalars (a sweep's np.arange or np.linspace) are the Python numbers they hold
    numbers = C.typed(C.replace(base, model={"n_layer": np.int64(3)}, optim={"lr": np.float32(0.5)},
                                train={"steps": np.array(4)}))  # fmt: skip
    assert (numbers.model.n_layer, numbers.optim.lr, numbers.train.steps) == (3, 0.5, 4)
    assert type(numbers.model.n_layer) is int and type(numbers.optim.lr) is float and type(numbers.train.steps) is int
    for changes, message in [
        ({"model": {"n_layer": "x"}}, "bad value for 'model.n_layer' in the config: Value 'x' of type 'str' could not "
                                      "be converted to Integer; model.n_layer takes an integer"),
        ({"model": {"n_layer": 2.5}}, "Value '2.5' of type 'float' could not be converted to Integer"),
        ({"optim": {"lr": "abc"}}, "bad value for 'optim.lr' in the config"),
        ({"model": {"n_layer": np.float64(2.5)}}, "Value '2.5' of type 'float' could not be converted to Integer"),
    ]:  # fmt: skip
        with pytest.raises(C.ConfigError, match=re.escape(message)):
            train(C.replace(base, **changes))
    assert not os.path.exists(tmp_path / "run")  # refused before the run directory
    with pytest.raises(C.ConfigError, match=r"^unknown config key 'model.n_layr'; did you mean 'model.n_layer'\?"):
        C.replace(base, model={"n_layr": 2})
    with pytest.raises(C.ConfigError, match=r"^unknown config key 'modl'; did you mean 'model'\?"):
        C.replace(base, modl={})
    with pytest.raises(C.ConfigError, match=r"^a Config is needed \(lm.config.load\(PRESET, \[OVERRIDES\]\)\), got d"):
        train({"model": {}})
    assert C.load(pathlib.Path(C.find_preset("tiny")), None) == C.load("tiny")
    with pytest.raises(C.ConfigError, match=r"^overrides are a list of key=value strings, got \[3\]"):
        C.load("tiny", [3])


def test_sections_lists_and_text_given_the_wrong_shape_say_how_to_write_them(tmp_path):
    """A section given one value in a file, data.sources given no list, one item of a list set by index, a text
    setting left null in a file and a second config file each got omegaconf's words alone ("Merge error: str is not
    a subclass of ModelConfig", "AnyNode is not a ListConfig", "data.sources takes a list, not a mapping" for a
    list, "override 'b.yaml' is not key=value"); a section whose keys are all left out (`model:`) was refused."""
    for text in ["model: 3\n", "model: [3]\n"]:
        assert load_error(write(tmp_path, text)).endswith(
            "preset.yaml: model is a section, not a value: write its keys below it, indented ('model:', then a line "
            "'  KEY: VALUE' for each)"
        )
    assert C.load(write(tmp_path, "model:\ntrain:\n  steps: 7\n")).train.steps == 7  # model: its defaults
    sources = ("data.sources takes a list of sources, e.g. data.sources=[{path: a.txt, weight: 2},"
               "{path: b.txt, weight: 1}]")  # fmt: skip
    assert load_error(write(tmp_path, "data:\n  sources: foo\n")).endswith(sources)
    assert load_error(None, ["data.sources=foo"]).endswith(sources)
    assert load_error(None, ["data.sources=[{path: a.txt}]", "data.sources.0.weight=2"]) == (
        f"override 'data.sources.0.weight=2': data.sources is a list, set whole (data.sources=[...]), not item by "
        f"item; {sources}"
    )
    assert "lora.targets is a list, set whole (lora.targets=[...]), not item by item" in load_error(
        None, ["lora.targets.1=qkv"]
    )
    for item in ["lora.targets[1]=qkv", "data.sources[0].weight=2"]:  # (omegaconf's spelling of an item: it said
        listed = item.split("[")[0]  # "takes a list, not a mapping: write [...] around its items", or "do not merge")
        assert f"{listed} is a list, set whole ({listed}=[...]), not item by item" in load_error(None, [item])
    for text in ["run:\n  dir:\n", "data: {path: null}\n"]:
        assert load_error(write(tmp_path, text)).endswith("takes text ('' for none)")
    # a source given as a path alone, or an entry's field of the wrong type, said omegaconf's words alone
    # ("str is not a subclass of SourceConfig", "could not be converted to Float"), naming no fix
    assert load_error(write(tmp_path, "data:\n  sources: [a.txt, b.txt]\n")).endswith(sources)
    assert load_error(None, ["data.sources=[{path: a.txt, weight: abc}]"]).endswith(
        "; a data.sources entry's weight takes a number > 0, e.g. {path: a.txt, weight: 2}"
    )
    assert load_error(None, ["data.sources=[{path: [a.txt, b.txt]}]"]).endswith(
        "; a data.sources entry's path takes text, e.g. {path: a.txt, weight: 2}"
    )
    assert C.load(None, ["data.path=null"]).data.path == "null"  # (an override's text is the text written)
    second = write(tmp_path, "seed: 3\n", "second.yaml")
    assert load_error("tiny", [second]).startswith(
        f"'{second}' is a second config file; one is read ({C.find_preset('tiny')}): merge them into one file, or "
        "give the second's settings as key=value overrides"
    )
    assert load_error("tiny", ["shakespeare_char"]).startswith(  # (a preset by name: "is not key=value")
        "'shakespeare_char' is a second config file; one is read"
    )


def test_the_last_override_wins():
    cfg = C.load(None, ["model.n_layer=3", "model.n_layer=5", "optim.lr=3e-4", "model.pos=rope"])
    assert (cfg.model.n_layer, cfg.optim.lr, cfg.model.pos) == (5, 3e-4, "rope")
    assert isinstance(cfg.model, C.ModelConfig) and isinstance(cfg.optim.lr, float)


def test_overrides_apply_on_top_of_a_preset(tmp_path):
    preset = write(tmp_path, "model:\n  n_layer: 6\n  n_embd: 96\ndata:\n  block_size: 64\nseed: 7\n")
    cfg = C.load(preset, ["model.n_layer=8", "train.steps=10"])
    assert cfg.model.n_layer == 8  # override beats preset
    assert cfg.model.n_embd == 96 and cfg.data.block_size == 64 and cfg.seed == 7  # preset beats defaults
    assert cfg.train.steps == 10
    assert cfg.model.n_head == C.ModelConfig().n_head  # untouched fields keep their defaults


def test_preset_with_an_unknown_key(tmp_path):
    message = load_error(write(tmp_path, "model:\n  nlayer: 3\n"))
    assert "'model.nlayer'" in message and "did you mean 'model.n_layer'" in message


def test_preset_with_a_misspelt_section(tmp_path):
    message = load_error(write(tmp_path, "modle:\n  n_layer: 3\n"))
    assert "'modle'" in message and "did you mean 'model'" in message


def test_preset_with_a_bad_value(tmp_path):
    path = write(tmp_path, "model:\n  n_layer: abc\n")
    message = load_error(path)
    assert "model.n_layer" in message and path in message and "abc" in message


def test_a_true_or_false_setting_takes_yaml_spellings_of_true_and_false_and_nothing_else(tmp_path):
    """(omegaconf read any number as a boolean: model.bias=2 built biases, where 2 was a slip for another key.)"""
    assert C.load(write(tmp_path, "model:\n  bias: no\n  qk_norm: On\n"), ["model.tie_embeddings=0"]).model == \
        C.ModelConfig(bias=False, qk_norm=True, tie_embeddings=False)
    message = load_error(write(tmp_path, "model:\n  bias: 2\n"))
    assert "'model.bias'" in message and "'2' is not true or false" in message and "preset.yaml" in message
    preset = write(tmp_path, "model:\n  bias: false\n  qkv_bias: ${model.bias}\n")
    given = C.load(preset, ["model.qk_norm=${model.bias}"]).model  # (an interpolation was refused as not a bool)
    assert (given.qkv_bias, given.qk_norm) == (False, False)


def test_preset_with_a_bad_choice_and_a_failed_check(tmp_path):
    assert "did you mean 'gelu'" in load_error(write(tmp_path, "model:\n  mlp: gelU\n"))
    assert "train.grad_accum=4" in load_error(write(tmp_path, "data:\n  batch_size: 6\ntrain:\n  grad_accum: 4\n"))


@pytest.mark.parametrize("name", ["nope.yaml", "no_such_preset"])
def test_missing_preset_file(tmp_path, name):
    missing = str(tmp_path / name)
    message = load_error(missing)
    assert missing in message and "not found" in message


def test_a_files_format_version_set_to_an_interpolation_is_one_line(tmp_path):
    """format_version: ${x} in a file was resolved to be checked: omegaconf's raw traceback (its override was fixed)."""
    message = load_error(write(tmp_path, "format_version: ${x}\nseed: 1\n"))
    assert "format_version" in message and "must be a positive integer" in message


def test_preset_from_a_newer_lm(tmp_path):
    message = load_error(write(tmp_path, f"format_version: {C.FORMAT_VERSION + 1}\nmodel:\n  new_field: 1\n"))
    assert "format_version" in message and "upgrade" in message


@pytest.mark.parametrize(
    "text",
    ["- a\n- b\n", "model: [1\n", "model:\n\tn_layer: 3\n", "model: 3\n"],
    ids=["list", "unclosed", "tab", "section_scalar"],
)
def test_malformed_preset(tmp_path, text):
    path = write(tmp_path, text)
    assert path in load_error(path)


def test_empty_preset_means_defaults(tmp_path):
    assert C.load(write(tmp_path, "")) == C.Config()


def test_save_then_load_round_trips(tmp_path):
    cfg = C.load(
        None,
        [
            "seed=3",
            "resume=never",
            "model.n_kv_head=2",
            "model.pos=rope",
            "model.dtype=bfloat16",
            "model.scan_layers=true",
            "model.norm_eps=1e-6",
            "optim.lr=3e-4",
            "train.peak_flops=1.5e14",
            "mesh.data=-1",
            "data.tokenizer=bpe:512",
        ],
    )
    # Strings YAML would otherwise read as numbers, booleans or comments.
    cfg = C.replace(cfg, run={"name": "1e3"}, data={"path": "a: b #c", "field": "yes"}, init_from="007")
    path = str(tmp_path / "config.yaml")
    C.save(cfg, path)
    assert C.load(path) == cfg
    assert not os.path.exists(path + ".tmp")
    with open(path) as f:
        assert f.read() == C.to_yaml(cfg)


def test_replace_changes_only_what_it_names():
    cfg = C.Config()
    new = C.replace(cfg, model={"n_layer": 9}, seed=4)
    assert new.model.n_layer == 9 and new.seed == 4
    assert new.model.n_head == cfg.model.n_head and new.optim == cfg.optim
    assert cfg.model.n_layer == C.ModelConfig().n_layer  # frozen: the original is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.n_layer = 3


def test_from_dict_round_trips_and_rejects_unknown_keys():
    cfg = C.load(None, ["model.n_layer=3", "model.pos=rope", "optim.lr=3e-4"])
    assert C.from_dict(dataclasses.asdict(cfg)) == cfg
    raw = dataclasses.asdict(cfg)
    raw["model"]["nlayer"] = 3
    with pytest.raises(C.ConfigError, match="did you mean 'model.n_layer'"):
        C.from_dict(raw)


def test_differences_name_each_changed_field():
    a, b = C.ModelConfig(), C.ModelConfig(n_layer=9, pos="rope")
    assert C.differences(a, a) == []
    assert sorted(C.differences(a, b)) == [f"n_layer {a.n_layer} vs 9", "pos learned vs rope"]
    # values as a config writes them, not as Python prints them
    c = dataclasses.replace(a, tie_embeddings=not a.tie_embeddings)
    assert f"tie_embeddings {str(a.tie_embeddings).lower()} vs {str(c.tie_embeddings).lower()}" in C.differences(a, c)


@pytest.mark.parametrize(
    "n_vocab, multiple, want", [(50257, 64, 50304), (256, 64, 256), (257, 64, 320), (50257, 1, 50257)]
)
def test_resolve_model_pads_the_vocabulary(n_vocab, multiple, want):
    m = C.resolve_model(C.ModelConfig(vocab_multiple=multiple), n_vocab, block_size=128)
    assert m.vocab_size == want and m.max_seq_len == 128


def test_resolve_model_keeps_explicit_sizes():
    m = C.resolve_model(C.ModelConfig(vocab_size=1000, max_seq_len=512), 300, block_size=128)
    assert (m.vocab_size, m.max_seq_len) == (1000, 512)


def test_resolve_model_rejects_what_cannot_fit():
    with pytest.raises(C.ConfigError, match="vocab_size"):
        C.resolve_model(C.ModelConfig(vocab_size=100), 300, block_size=128)
    with pytest.raises(C.ConfigError, match="block_size"):
        C.resolve_model(C.ModelConfig(max_seq_len=64), 300, block_size=128)


def test_every_choice_is_valid_in_its_field():
    # CHOICES must name real keys, and each default must be one of its choices.
    keys = set(C.all_keys())
    for key, choices in CHOICES.items():
        assert key in keys
        value = C.Config()
        for part in key.split("."):
            value = getattr(value, part)
        assert value in choices


def test_presets_are_found_by_name_from_any_directory(tmp_path, monkeypatch):
    presets = tmp_path / "repo" / "configs"
    presets.mkdir(parents=True)
    (presets / "small.yaml").write_text("model:\n  n_layer: 2\n")
    monkeypatch.setattr(C, "CONFIG_DIR", str(presets))
    monkeypatch.chdir(tmp_path)
    for name in ["small", "small.yaml", "configs/small.yaml", str(presets / "small.yaml")]:
        assert C.load(name).model.n_layer == 2, name
    assert C.list_presets() == ["configs/small.yaml"]
    message = load_error("smal")
    assert "'smal' not found" in message and "configs/small.yaml" in message


PRESETS = sorted(glob.glob(os.path.join(C.CONFIG_DIR, "*.yaml")))


def test_list_presets_finds_the_yaml_files():
    assert [os.path.basename(p) for p in C.list_presets()] == [os.path.basename(p) for p in PRESETS]


@pytest.mark.parametrize("preset", PRESETS, ids=os.path.basename)
def test_bundled_presets_load_and_validate(preset):
    cfg = C.load(preset)
    C.validate(cfg)
    assert cfg.format_version <= C.FORMAT_VERSION
    # A preset is also found by its name alone, from any working directory.
    name = os.path.basename(preset)
    assert C.load(name) == cfg
    assert C.load(name[: -len(".yaml")]) == cfg


def test_presets_and_overrides_merge_into_read_only_sections(monkeypatch, tmp_path):
    # omegaconf before 2.4 marks the sections of frozen dataclasses read-only, and its merge then refuses
    # every preset value and override; load() makes each section writable first.
    structured = C.OmegaConf.structured

    def read_only(obj):
        node = structured(obj)
        for section in [node, *(v for v in node.values() if isinstance(v, C.DictConfig))]:
            C.OmegaConf.set_readonly(section, True)
        return node

    monkeypatch.setattr(C.OmegaConf, "structured", read_only)
    node = C._writable(C.OmegaConf.structured(C.Config))
    assert not any(C.OmegaConf.is_readonly(s) for s in [node, *node.values()] if isinstance(s, C.DictConfig))
    preset = tmp_path / "p.yaml"
    preset.write_text("model:\n  n_layer: 3\n")
    cfg = C.load(str(preset), ["train.steps=7"])
    assert (cfg.model.n_layer, cfg.train.steps) == (3, 7)
    assert C.from_dict(dataclasses.asdict(cfg)) == cfg


def test_a_path_from_home_is_the_home_directorys():
    """No shell expands `data.path=~/x` (nor does YAML): a literal ./~ directory was made, or the file not found."""
    home = os.path.expanduser("~")
    cfg = C.load(None, ["data.path=~/corpus.txt", "run.dir=~/runs/a", "init_from=~/base", "data.cache_dir=~/c",
                                 "data.sources=[]", "train.eval_tasks=[~/t.jsonl]"])  # fmt: skip
    assert (cfg.data.path, cfg.run.dir, cfg.init_from, cfg.data.cache_dir, cfg.train.eval_tasks) == (
        f"{home}/corpus.txt", f"{home}/runs/a", f"{home}/base", f"{home}/c", (f"{home}/t.jsonl",))
    assert C.load(None, ["run.name=grp/sub", "run.dir=/tmp/grp/sub"]).run.dir == "/tmp/grp/sub"  # (the name is unused)
    assert C.load(None, ["init_from=hf:~/models/x"]).init_from == f"hf:{home}/models/x"  # (was made ./~/models/x)
    mixed = C.load(None, ["data.sources=[{path: ~/a.txt, val_path: ~/b.txt}]"]).data.sources[0]
    assert (mixed.path, mixed.val_path) == (f"{home}/a.txt", f"{home}/b.txt")


def test_set_keys_names_each_key_of_a_mapping_given_whole():
    """sample={temperature: 0.3} chose sample.temperature: a fine-tune kept init_from's temperature instead, as if
    the user had set nothing (set_keys named only "sample")."""
    keys = C.set_keys(None, ["sample={temperature: 0.3, max_new_tokens: 7}", "model.n_layer=2", "seed=3"])
    assert {"sample.temperature", "sample.max_new_tokens", "model.n_layer", "seed"} <= keys
    assert "sample.top_k" not in keys


def test_keys_prints_the_configuration_with_each_keys_meaning(tmp_path, capsys):
    """train.py --keys [SECTION_OR_KEY]: the preset with the overrides as YAML that loads back to the same config,
    each key with its comment in lm/config.py (every key has one), without training."""
    from lm import train as train_lib

    assert set(C.key_comments()) >= set(C.all_keys())  # a key added without its comment would print none
    overrides = ["data.sources=[{path: a.txt, weight: 2}, {path: b.txt}]", "lora.rank=4", "lora.targets=[q, v]",
                 "init_from=base", "run.name=cost \\${x} # not a comment", "optim.lr=3e-4"]  # fmt: skip
    cfg = C.load("tiny", overrides)
    text = C.annotated_yaml(cfg)
    assert "  n_layer: 2  # number of transformer blocks\n" in text and text.count("  # ") >= len(C.all_keys())
    assert C.load(write(tmp_path, text), []) == cfg
    assert train_lib.main(["tiny", "optim.lr=3e-4", "--keys", "optim.lr"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out == ("optim:\n  lr: 0.0003  # peak learning rate (with muon: of the AdamW group, "
                                 "embeddings, head, norms and biases)\n")  # fmt: skip
    assert train_lib.main(["--keys", "lora"]) == 0 and capsys.readouterr().out.startswith("lora:\n  rank: 0  # ")
    assert train_lib.main(["--keys", "model.nlayer"]) == 2
    assert capsys.readouterr().err == "error: unknown config key 'model.nlayer'; did you mean 'model.n_layer'?\n"


@pytest.mark.parametrize(
    "fmt, override, applies",
    [
        ("preference", "data.completion_field=answer", "data.format=examples,"),
        ("preference", "data.field=body", "data.format=text (or examples),"),
        ("chat", "data.prompt_field=question", "data.format=examples (or preference),"),
        ("examples", "data.shard_mb=64.5", "data.format=text,"),  # (fine-tune data is prepared as one file)
        ("chat", "data.workers=4", "data.format=text,"),  # (and by one process)
    ],
)
def test_a_record_field_the_data_format_never_reads_is_refused(fmt, override, applies):
    """(data.completion_field=answer on preference pairs trained as if it were not there: a setting that did
    nothing, where data.pair_overflow on task data was refused.)"""
    dpo = ["train.objective=dpo", "init_from=x"] if fmt == "preference" else []
    key = override.split("=")[0]
    with pytest.raises(C.ConfigError, match=re.escape(f"{override} applies only to {applies} and data.format is {fmt}; ")
                       + f".*drop {re.escape(key)}$"):
        C.load("tiny", [f"data.format={fmt}", *dpo, override])
    C.load("tiny", ["data.format=preference", *(["train.objective=dpo", "init_from=x"]), "data.prompt_field=question"])
    C.load("tiny", ["data.format=examples", "data.completion_field=answer", "data.field=body"])


def test_a_validation_share_with_validation_data_given_is_refused():
    """(data.val_fraction=0.5 with data.val_path trained and validated as if the share were not there.)"""
    with pytest.raises(C.ConfigError, match=r"^data.val_fraction=0.5 applies only to data.val_path='' \(validation held "
                       r"out of data.path\), and data.val_path is b.txt; .* or drop data.val_fraction$"):  # fmt: skip
        C.load("tiny", ["data.path=a.txt", "data.val_path=b.txt", "data.val_fraction=0.5"])
    C.load("tiny", ["data.path=a.txt", "data.val_path=b.txt", "data.val_fraction=0"])  # none held out, as it says


def test_no_validation_share_without_validation_data_says_why_and_both_fixes(tmp_path):
    """(It said only to give data.val_path, which a prepared data.path refuses: dropping data.val_fraction is the
    fix there. eval_every=0 still evaluates at the end, so validation data is needed.) A data.path prepared on this
    disk is left to its own line, which names only the fix that works there (a data.val_path would be refused)."""
    with pytest.raises(C.ConfigError, match=r"^data.val_fraction=0 holds out no validation data, which every run "
                       r"evaluates on \(at least at its end\); give data.val_path .*, or drop data.val_fraction$"):
        C.load("tiny", ["data.path=prepared_dir", "data.val_fraction=0", "train.eval_every=0"])
    from lm.data.prepare import prepare, prepare_source

    prepared = str(tmp_path / "prepared")
    (tmp_path / "t.txt").write_text("some text to hold out a share of " * 40)
    prepare([str(tmp_path / "t.txt")], "bytes", prepared, progress=False)
    cfg = C.load("tiny", [f"data.path={prepared}", "data.val_fraction=0", "data.tokenizer=bytes"])
    with pytest.raises(UserError, match=r"^data.val_fraction=0 is given, but data.path=.* is already prepared, with "
                       r"its own validation split \(the last 0.1 of its tokens\); drop data.val_fraction$"):
        prepare_source(cfg.data, prepared)
    with pytest.raises(C.ConfigError, match=r"^data.val_fraction=0 holds out nothing of data.sources\[0\], which has "
                       r"no val_path; give it one .*, or drop data.val_fraction \(a prepared directory holds out "):
        C.load("tiny", ["data.sources=[{path: prepared_dir}, {path: b.txt, val_path: v.txt}]", "data.val_fraction=0"])


def test_a_validation_share_in_a_mixture_whose_sources_all_have_validation_data_is_refused():
    """(Every source with a val_path: data.val_fraction=0.2 held out nothing, and the run said nothing.)"""
    both = "data.sources=[{path: a.txt, val_path: a_val.txt}, {path: b.txt, val_path: b_val.txt}]"
    with pytest.raises(C.ConfigError, match=r"^data.val_fraction=0.2 holds out a share of each source without a "
                       r"val_path, and every data.sources entry has one, .*; drop data.val_fraction$"):  # fmt: skip
        C.load("tiny", [both, "data.val_fraction=0.2"])
    C.load("tiny", [both, "data.val_fraction=0"])  # none held out, as it says
    C.load("tiny", ["data.sources=[{path: a.txt, val_path: a_val.txt}, {path: b.txt}]", "data.val_fraction=0.2"])


def test_epochs_beyond_the_step_counter_are_refused_before_any_data_is_read():
    """(data.epochs=2**40 on examples packed epoch after epoch at start-up, silently, for hours.)"""
    with pytest.raises(C.ConfigError, match=r"^data.epochs must be in \[0, 2\*\*31\) .*, got 1099511627776$"):
        C.load("tiny", ["data.format=examples", "data.path=x.jsonl", "data.epochs=1099511627776"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        # (each trained, exit 0: RoPE the identity, no position at all; llama3's kept band gone)
        (["model.pos=rope", "model.rope_scaling=linear", "model.rope_factor=inf"],
         r"^model.rope_factor must be a finite number >= 1, got inf$"),
        (["model.pos=rope", "model.rope_scaling=llama3", "model.rope_high_freq_factor=inf"],
         r"^model.rope_scaling=llama3 needs .*, both finite, got 1.0 and inf$"),
        # (attention dropout runs lm's einsum attention: cuDNN, insisted on, was never asked for)
        (["model.attention=cudnn", "model.attn_dropout=0.1"],
         r"^model.attn_dropout=0.1 runs lm's einsum attention, never cuDNN's, so model.attention=cudnn would not "),
        (["model.attention=xla", "model.attn_dropout=0.1"],  # (it trained with lm's einsum attention, unsaid)
         r"^model.attn_dropout=0.1 runs lm's einsum attention, never XLA's, so model.attention=xla would not train "),
    ],
)
def test_model_options_that_would_silently_not_act_are_refused(overrides, message):
    with pytest.raises(C.ConfigError, match=message):
        C.load("tiny", overrides)


def test_a_preset_after_the_overrides_is_said_to_come_first(capsys):
    """`train.py model.n_layer=1 configs/tiny.yaml` said "'configs/tiny.yaml' is a second config file; one is read
    (.../default.yaml)", a file the user never gave."""
    from lm import train as train_lib
    from lm.scripts import command_line

    for preset in ["configs/tiny.yaml", "tiny"]:
        assert train_lib.main(["model.n_layer=1", preset, "train.steps=2"]) == 2
        fixed = f"{command_line('train')} {preset} model.n_layer=1 train.steps=2"
        said = f"error: the config file '{preset}' comes first, before the key=value overrides: {fixed}\n"
        assert capsys.readouterr().err == said


def test_run_name_and_dir_given_as_a_mapping_are_both_given(tmp_path, capsys):
    """`run={name: a, dir: D}` trained in D, run.name unused without a word (run.name=a run.dir=D is refused)."""
    from lm import train as train_lib

    assert train_lib.main(["tiny", f"run={{name: a, dir: {tmp_path}/r}}"]) == 2
    assert capsys.readouterr().err.startswith("error: run.dir and run.name are both given")
    assert not os.path.exists(tmp_path / "r")


def test_a_boolean_interpolation_takes_only_true_or_false():
    """model.qk_norm=${train.steps} was true (omegaconf reads any integer as a bool), though model.qk_norm=2 is
    refused."""
    assert load_error("tiny", ["model.qk_norm=${train.steps}"]) == (
        "bad value for 'model.qk_norm' in its interpolation ${train.steps}: 20 is not true or false; model.qk_norm "
        "takes true or false"
    )
    assert "'2' is not true or false" in load_error(None, ["model.bias=${oc.env:LM_NO_SUCH_VARIABLE,2}"])
    cfg = C.load(None, ["model.qk_norm=true", "model.bias=${model.qk_norm}", "model.fused_qkv=${oc.env:LM_NO_SUCH,no}"])
    assert (cfg.model.bias, cfg.model.fused_qkv) == (True, False)


def test_spaces_around_an_overrides_key_are_named():
    """'model.n_layer = 3' (quoted) was "unknown config key 'model.n_layer '; did you mean 'model.n_layer'?"."""
    for item in ["model.n_layer = 3", " model.n_layer=3", "model.n_layer =3"]:
        assert load_error(None, [item]) == (f"override '{item}' has spaces around its key; write it without them "
                                            "(model.n_layer=3)")
    assert C.load(None, ["model.n_layer= 3"]).model.n_layer == 3  # (a value's spaces: YAML drops them)
    # an empty value is quoted as written (it was 'model.n_layer=''', with the '' lm reads it as)
    said = "bad value for 'model.n_layer' in override 'model.n_layer=': "
    assert load_error(None, ["model.n_layer="]).startswith(said)


def test_keys_given_the_config_says_the_config_comes_first(capsys):
    """`train.py --keys tiny`: --keys took the preset as its SECTION_OR_KEY and said "unknown config key 'tiny';
    did you mean 'train'?"."""
    from lm import train as train_lib
    from lm.scripts import command_line

    for preset in ["tiny", "configs/tiny.yaml"]:
        assert train_lib.main(["--keys", preset, "optim.lr=3e-4"]) == 2
        said = (f"error: --keys takes a section or key (optim, model.n_layer), not the config '{preset}'; give the "
                f"config first: {command_line('train')} {preset} optim.lr=3e-4 --keys\n")
        assert capsys.readouterr().err == said
    assert train_lib.main(["--keys", "train.steps", "tiny"]) == 0  # a key, then the preset: as it was
    assert capsys.readouterr().out == "train:\n  steps: 20  # optimizer steps\n"


def test_keys_given_an_override_says_the_overrides_come_first(capsys):
    """`train.py tiny --keys optim.lr=1e-3`: --keys took the override as its SECTION_OR_KEY and said "unknown config
    key 'optim.lr=1e-3'; did you mean 'optim.lr'?", and that command showed optim.lr without the override."""
    from lm import train as train_lib
    from lm.scripts import command_line

    assert train_lib.main(["tiny", "train.steps=3", "--keys", "optim.lr=1e-3"]) == 2
    said = ("error: --keys takes a section or key (optim, model.n_layer), not the override 'optim.lr=1e-3'; give the "
            f"overrides before it: {command_line('train')} tiny train.steps=3 optim.lr=1e-3 --keys\n")
    assert capsys.readouterr().err == said
    assert train_lib.main(["tiny", "train.steps=3", "optim.lr=1e-3", "--keys", "optim.lr"]) == 0  # as advised
    assert capsys.readouterr().out.endswith("  lr: 0.001  # peak learning rate (with muon: of the AdamW group, "
                                            "embeddings, head, norms and biases)\n")


def test_keys_advice_keeps_the_order_and_quoting_of_what_was_typed(capsys):
    """`train.py tiny --keys model.n_layer=2 model.n_layer=3` advised `tiny model.n_layer=3 model.n_layer=2 --keys`,
    which shows n_layer 2 where 3 was meant; a value with a space came back unquoted, and a misplaced preset's
    advice left out `--keys` and `-q` (followed, it trained)."""
    from lm import train as train_lib
    from lm.scripts import command_line

    assert train_lib.main(["tiny", "--keys", "model.n_layer=2", "model.n_layer=3", "run.name=a b"]) == 2
    said = ("error: --keys takes a section or key (optim, model.n_layer), not the override 'model.n_layer=2'; give the "
            f"overrides before it: {command_line('train')} tiny model.n_layer=2 model.n_layer=3 'run.name=a b' "
            "--keys\n")
    assert capsys.readouterr().err == said
    assert train_lib.main(["--keys", "tiny", "-q", "run.name=a b"]) == 2
    assert capsys.readouterr().err.endswith(f"config first: {command_line('train')} tiny -q 'run.name=a b' --keys\n")
    assert train_lib.main(["model.n_layer=1", "tiny", "-q", "--keys", "optim"]) == 2
    fixed = f"{command_line('train')} tiny model.n_layer=1 -q --keys optim"
    assert capsys.readouterr().err.endswith(f"overrides: {fixed}\n")
    assert train_lib.main(["tiny", "model.n_layer=2", "model.n_layer=3", "--keys", "model.n_layer"]) == 0  # as advised
    assert capsys.readouterr().out == "model:\n  n_layer: 3  # number of transformer blocks\n"


def test_keys_with_init_from_says_the_model_comes_from_the_weights(capsys):
    """--keys with init_from printed the preset's model (4 x 128) as if the run would train it, without a word."""
    from lm import train as train_lib

    assert train_lib.main(["tiny", "init_from=runs/base", "--keys", "model.n_layer"]) == 0
    out = capsys.readouterr().out
    comment = "# init_from: the model and sample settings and data.tokenizer that this config does not set come "
    assert out.startswith(comment)  # (sample: a fine-tune samples as its base run did, which the comment left out)
    assert out.endswith("\nmodel:\n  n_layer: 2  # number of transformer blocks\n")  # (still YAML that loads back)


def test_a_python_script_given_as_the_config_is_named_as_such(tmp_path):
    """`train.py configs/make_finetune_example.py` said "cannot parse ...: did not find expected <document start> at
    line 1; fix the YAML there". An installed lm-train said to run lm's own by its path in site-packages, and named
    train.py, which an install has not."""
    from lm.scripts import command_line

    script = write(tmp_path, '"""Writes data."""\nimport sys\nprint(sys.argv)\n', "make_data.py")
    assert load_error(script) == (f"{script} is a Python script, not a config (a YAML file): run it with python "
                                  f"{script}, and give {command_line('train')} a .yaml config or a preset")
    # One of lm's own (installed, it lies in site-packages): the module that runs from any directory.
    assert load_error("configs/make_finetune_example.py").endswith(
        "is a Python script, not a config (a YAML file): run it with python -m lm.configs.make_finetune_example, "
        f"and give {command_line('train')} a .yaml config or a preset")


def test_keys_shows_the_run_directory_and_refusals_the_run_would_have(tmp_path, capsys):
    """--keys printed the config before train.py's own run settings: a run's config.yaml with run.name=NEW showed
    the old run's run.dir (the run went to runs/NEW), and run.dir with run.name, which a run refuses, exited 0."""
    from lm import train as train_lib

    old = tmp_path / "runs" / "old"
    old.mkdir(parents=True)
    C.save(C.load("tiny", [f"run.dir={old}"]), str(old / "config.yaml"))
    (old / "status.json").write_text("{}")
    assert train_lib.main([str(old / "config.yaml"), "run.name=new", "--keys", "run.dir"]) == 0
    assert capsys.readouterr().out.startswith("run:\n  dir: ''  # ")
    assert train_lib.main(["tiny", "run.name=a", f"run.dir={tmp_path / 'b'}", "--keys"]) == 2
    assert "run.dir and run.name are both given" in capsys.readouterr().err


def test_a_new_run_from_a_bucket_runs_config_yaml_drops_its_local_copy(tmp_path, capsys):
    """A run in a bucket with its own run.local_dir records it; a new run from that config.yaml (run.name=NEW, in
    runs/NEW) was refused with "a local run.dir needs none: drop run.local_dir", which the command never gave."""
    from lm import train as train_lib

    C.save(C.load("tiny", ["run.dir=s3://bucket/runs/old", f"run.local_dir={tmp_path / 'copy'}"]),
           str(tmp_path / "config.yaml"))  # fmt: skip
    assert train_lib.main([str(tmp_path / "config.yaml"), "run.name=new", "--keys", "run"]) == 0
    assert "  local_dir: ''  # " in capsys.readouterr().out


def test_a_config_file_that_is_not_utf8_says_so(tmp_path):
    """A UTF-16 (or Latin-1) config said "cannot parse X: 'utf-8' codec can't decode byte 0xff in position 0: invalid
    start byte; fix the YAML there": the YAML was right, its encoding not."""
    for name, data in [("utf16.yaml", "model:\n  n_layer: 3\n".encode("utf-16")),
                       ("latin1.yaml", "model:\n  n_layer: 3  # café\n".encode("latin-1"))]:  # fmt: skip
        path = tmp_path / name
        path.write_bytes(data)
        assert load_error(str(path)) == (f"{path} is not UTF-8 text (a config is YAML in UTF-8; some Windows editors "
                                         "save UTF-16 or Latin-1): save it as UTF-8")  # fmt: skip


def test_a_list_interpolation_that_resolves_is_not_named_for_another_ones_failure():
    """(data.sources=${oc.select:...,[]}, a list, was named for lora.targets=${model.n_layer}'s failure.)"""
    with pytest.raises(C.ConfigError, match="bad value for .lora.targets."):
        C.load("tiny", ["data.sources=${oc.select:model.nothing,[]}", "lora.targets=${model.n_layer}"])
