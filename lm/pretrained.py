"""Trained models to sample from or start from: lm checkpoints and Hugging Face model directories (lm.hf).

    params, model_cfg, tokenizer = load("runs/NAME")            # latest checkpoint of a run
    params, model_cfg, tokenizer = load("runs/NAME/checkpoints/500")
    params, model_cfg, tokenizer = load("hf:path/to/model")     # GPT-2, Llama, Mistral, Qwen2, Qwen3

A checkpoint of a LoRA run holds only its adapters; loading it loads the base model it names
(its init_from) and merges the adapters in, so callers always get plain parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Collection
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from lm import checkpoint as ckpt_lib
from lm import lora, platform, sharding, storage
from lm.config import TRAINING_OPTIONS, ModelConfig, SampleConfig, shown_value
from lm.errors import UserError
from lm.files import check_unicode_path
from lm import hf
from lm.model import init_params, laid_out
from lm.tokenizer import Tokenizer

HF_PREFIX = "hf:"

def _shardings(model_cfg: ModelConfig, mesh) -> Any:
    boxed = jax.eval_shape(functools.partial(init_params, model_cfg), jax.random.key(0))
    if mesh is None:
        one = SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: one, nn.unbox(boxed))
    return sharding.param_shardings(boxed, mesh)


def in_layout(params: Any, trained: ModelConfig, model: ModelConfig, mesh=None) -> Any:
    """`params` of model `trained` in the layout of `model`, whose model.scan_layers a run from them chooses (the
    same weights, stacked or not), laid out over `mesh` as load lays them out."""
    if trained.scan_layers == model.scan_layers:
        return params
    return jax.device_put(laid_out(params, trained, model.scan_layers), _shardings(model, mesh))


def checkpoint_source(path: str, step: int | None = None, best: bool = False) -> str:
    """What `path` with `step` / `best` names, decided once: hf:DIR as it is, else the chosen step's directory
    (RUN_DIR/checkpoints/N), which config_and_tokenizer and load then read without choosing again."""
    if path.startswith(HF_PREFIX):
        if step is not None or best:
            raise UserError(
                f"a step or the best checkpoint is chosen among a run's checkpoints, not in {path}; drop it"
            )
        return path
    directory, step = ckpt_lib.find(path, step, best)
    return f"{directory}/{step}"


def config_and_tokenizer(path: str) -> tuple[ModelConfig, Tokenizer]:
    """The model config and tokenizer of trained weights, without reading the weights (but for hf:)."""
    path = os.fspath(path)
    if path.startswith(HF_PREFIX):
        return hf.config_and_tokenizer(hf_directory(path))
    directory, step = ckpt_lib.find(path)
    return runnable(ckpt_lib.load_config(directory, step).model), ckpt_lib.load_tokenizer(directory, step)


def runnable(model: ModelConfig) -> ModelConfig:
    """The model of trained weights as it runs here: model.attention=cudnn, which insists on cuDNN's kernel, becomes
    dot_product (the same attention by the kernel this platform picks: cuDNN's where it can run) where cuDNN cannot
    run, so that a run trained with it on a GPU samples, evaluates, exports and starts a run on a CPU too."""
    if model.attention == "cudnn" and platform.attention_kernel(platform.current(), "cudnn", model.dtype)[1]:
        return dataclasses.replace(model, attention="dot_product")
    return model


def hf_sample_settings(path: str, base: SampleConfig = SampleConfig()) -> tuple[SampleConfig, list[str]]:
    """(the sampling settings an hf:DIR recommends: its generation_config.json's over `base`, lm's defaults unless
    given, notes on what of them lm does not apply), lm.hf.generation's reading. (A run's are its config's
    `sample`.)"""
    return hf.sampling_defaults(hf_directory(path), base)


def sample_settings(path: str) -> SampleConfig:
    """The sampling settings trained weights are sampled with by default: a run's config `sample`, an hf:DIR's
    generation_config.json's over lm's defaults."""
    path = os.fspath(path)
    if path.startswith(HF_PREFIX):
        return hf_sample_settings(path)[0]
    return ckpt_lib.load_config(*ckpt_lib.find(path)).sample


def inherit_sampling(requested: SampleConfig, trained: SampleConfig, chosen: Collection[str] | None) -> SampleConfig:
    """The sampling settings of a run from trained weights: theirs (`trained`, sample_settings), but for those the
    user `chosen` (config.set_keys; None: those that differ from SampleConfig's defaults). A fine-tune of a model
    whose authors recommend settings (Llama 3's temperature 0.6, top_p 0.9) samples and exports with them."""
    mine = _chosen(requested, "sample", chosen)
    return dataclasses.replace(trained, **{name: getattr(requested, name) for name in mine})


def _chosen(requested: Any, section: str, chosen: Collection[str] | None) -> set[str]:
    """The fields of config `section` (a dataclass: `requested`) the user set: those `chosen` names (config.set_keys,
    e.g. "model.n_layer"), or where that is None, those that differ from the section's defaults."""
    if chosen is None:
        defaults = type(requested)()
        differ = lambda name: getattr(requested, name) != getattr(defaults, name)
        return {f.name for f in dataclasses.fields(requested) if differ(f.name)}
    return {key.removeprefix(f"{section}.") for key in chosen if key.startswith(f"{section}.")}


def load(
    path: str, step: int | None = None, best: bool = False, mesh=None
) -> tuple[Any, ModelConfig, Tokenizer]:
    """(params, model config, tokenizer) of trained weights (`path`: a run, checkpoint step or hf:DIR, a str or
    os.PathLike); the params sit on the first device, or are laid out over `mesh` by lm.sharding's rules."""
    path = os.fspath(path)
    if path.startswith(HF_PREFIX):  # each subtree placed as it is read: the host never holds every weight

        def placer(model_cfg: ModelConfig):
            shardings = _shardings(model_cfg, mesh)["params"]
            return lambda key, tree: jax.device_put(tree, shardings[key])

        return hf.load(hf_directory(path), placer=placer)
    directory, step = ckpt_lib.find(path, step, best)
    cfg = ckpt_lib.load_config(directory, step)
    cfg = dataclasses.replace(cfg, model=runnable(cfg.model))
    tokenizer = ckpt_lib.load_tokenizer(directory, step)
    if not cfg.lora.rank:
        like = sharding.abstract_like(
            nn.unbox(jax.eval_shape(functools.partial(init_params, cfg.model), jax.random.key(0))),
            _shardings(cfg.model, mesh),
        )
        return ckpt_lib.load_params(directory, step, like), cfg.model, tokenizer
    check_there(
        cfg.init_from, f"the LoRA adapters of {directory}/{step} were trained on",
        "a LoRA checkpoint holds only its adapters, and reads its base at every load",
    )  # fmt: skip
    warn_unpinned(cfg.init_from, f"LoRA checkpoint {directory}/{step}", f"{directory}/{step}")
    base, base_cfg, _ = load(cfg.init_from, mesh=mesh)
    check_base(cfg.init_from, base_cfg, cfg.model, f"the LoRA adapters of {directory}/{step} were trained on")
    check_weights(
        fingerprint(base), ckpt_lib.load_base_item(directory, step), cfg.init_from,
        f"the LoRA adapters of {directory}/{step} were trained on",
        "put those weights back there (a LoRA checkpoint holds only its adapters, and reads its base at every load)",
    )  # fmt: skip
    base = in_layout(base, base_cfg, cfg.model, mesh)  # (the adapters' layout: the LoRA run chose its scan_layers)
    # The base as training held it (lm.train casts it to model.param_dtype): a narrower one chosen is rounded to it, or
    # the adapters were merged onto another model than the one trained (float16's as bfloat16 too, as wide but another
    # rounding); a wider one holds the same values.
    narrow = jnp.dtype(cfg.model.param_dtype)
    base = jax.tree.map(lambda x: x.astype(narrow) if narrow.itemsize <= x.dtype.itemsize else x, base)
    shapes = jax.eval_shape(lambda p: lora.init_adapters(p, cfg.lora.rank, cfg.lora.targets, jax.random.key(0)), base)
    placed = jax.tree.leaves(base)[0].sharding
    replicated = placed if mesh is None else sharding.replicated(mesh)
    adapters = ckpt_lib.load_params(
        directory, step, sharding.abstract_like(shapes, jax.tree.map(lambda _: replicated, shapes))
    )
    return lora.merge(base, adapters, cfg.lora.alpha, cfg.lora.rank, cfg.model.dtype), cfg.model, tokenizer


def check_there(init_from: str, trained_on: str, why: str) -> None:
    """One line where the base that a run reads again (LoRA's, DPO's reference) is gone from its local path
    (`trained_on`: whose base it is, `why`: why it is read again), instead of hf:DIR's or a run's own."""
    path = init_from.removeprefix(HF_PREFIX)
    if not storage.is_url(path) and not os.path.exists(path):
        raise UserError(
            f"{trained_on} init_from={init_from}, which is no longer there (moved or deleted?); put it back there: "
            f"{why}"
        )


def warn_unpinned(init_from: str, whose: str, step_dir: str) -> None:
    """A warning line where a run that reads its base again (`whose`: "LoRA checkpoint X", "DPO checkpoint X")
    names a base run without its step (runs written before 2026-11-26, when a run began recording it) and that run
    holds more than one step: its newest is read, which is not the base trained on where the base trained on after.
    How to pin it: the step's own record (`step_dir`'s config item, which readers and a resume read)."""
    path = init_from.rstrip("/")
    if not path or path.startswith(HF_PREFIX) or storage.is_url(path) or os.path.basename(path).isdigit():
        return  # (hf:DIR has one model; a step directory is pinned)
    steps = ckpt_lib.complete_steps(path if os.path.basename(path) == "checkpoints" else f"{path}/checkpoints")
    if len(steps) > 1 and jax.process_index() == 0:
        run = path.removesuffix("/checkpoints")
        print(f"warning: {whose} names its base init_from={init_from} without its step (recorded since 2026-11-26) "
              f"and it holds {len(steps)} steps: reading its newest, {run}/checkpoints/{steps[-1]}, which is not "
              f"the one it trained on if that run trained on after it; to pin another, set init_from to "
              f"{run}/checkpoints/STEP in {step_dir}/config/metadata", file=sys.stderr)  # fmt: skip


SAMPLES = 16  # values of each tensor in a fingerprint


def fingerprint(params: Any) -> dict[str, list[float]]:
    """{tensor: 16 of its values, at places fixed by its shape, as float32 numbers}: what tells weights from others
    of the same shapes (a training step moves nearly every weight), gathered on the devices without bringing
    whole tensors to the host. A run that reads its base again (LoRA's, DPO's reference) keeps it with each
    checkpoint (lm.checkpoint's base item) and compares it at every resume and load."""
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(params)[0])
    picks = [np.unravel_index(np.random.default_rng(x.size).integers(0, x.size, SAMPLES), x.shape) for x in leaves]
    placed = leaves[0].sharding
    out = sharding.replicated(placed.mesh) if isinstance(placed, NamedSharding) else None  # every process reads it
    taken = jax.jit(lambda xs: [x[i].astype(jnp.float32) for x, i in zip(xs, picks)], out_shardings=out)(list(leaves))
    name = lambda path: "/".join(str(getattr(key, "key", key)) for key in path)  # params/h_0/attn/qkv/kernel
    return {name(path): np.asarray(t).tolist() for path, t in zip(paths, taken)}


def check_weights(found: dict[str, list[float]], recorded: dict | None, base: str, trained: str, fix: str) -> None:
    """Refuse a base (init_from `base`) whose weights are not those `trained` ("the LoRA adapters of X were trained
    on") recorded (fingerprint): a base run trained again in place, or a directory that now holds another model of
    the same shapes. `recorded` None: written before checkpoints recorded it, nothing to compare with."""
    if not recorded:
        return

    def same(name: str) -> bool:  # to rounding: a base that is itself a LoRA run is merged on the reading device
        got, want = np.asarray(found.get(name, []), np.float64), np.asarray(recorded[name], np.float64)
        scale = float(np.nanmax(np.abs(want), initial=0.0))
        return got.shape == want.shape and np.allclose(got, want, rtol=0, atol=1e-3 * scale, equal_nan=True)

    differ = [name for name in recorded if not same(name)] or sorted(found.keys() - recorded.keys())
    if differ:
        more = f" and {len(differ) - 1} more tensors" if len(differ) > 1 else ""
        raise UserError(f"the weights in {base} are not those {trained} ({differ[0]} differs{more}); {fix}")


def check_base(base: str, found: ModelConfig, trained: ModelConfig, what: str) -> None:
    """A LoRA checkpoint's adapters fit only the model they were trained on, read again from its base (init_from,
    whose model is `found`), as a DPO run's reference is: a base directory that now holds another model is one line
    (`what` ... trained on BASE, which now holds another model), not an error from deep inside the restore."""
    free = _free(found)  # (what inherit let the run choose)
    differ = [
        f"{f.name} {getattr(trained, f.name)} vs {getattr(found, f.name)}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in free and getattr(trained, f.name) != getattr(found, f.name)
    ]
    if differ:
        raise UserError(
            f"{what} {base}, which now holds another model ({', '.join(differ[:4])}); put that base model back "
            "there (a LoRA run reads it at every load, a DPO run at every resume)"
        )


def hf_directory(path: str) -> str:
    """The local directory hf:DIR names (a ~ expanded, file:///x read as /x), refused in one line where there is
    none."""
    directory = storage.user_path(path[len(HF_PREFIX) :])  # (hf:~/models/x: no shell expands it)
    check_unicode_path(directory)
    if not directory:
        raise UserError(f"{path!r} names no directory; write hf:DIR, e.g. hf:./gpt2 or hf:~/models/Llama-3.2-1B")
    if storage.is_url(directory):  # (lm.export writes one to a bucket: read from there, it is not a path)
        raise UserError(f"hf:DIR reads a directory on this machine, not {directory}; download it first "
                        f"({storage.download_command(directory)}), then give hf:DIR")  # fmt: skip
    if not os.path.isdir(directory):  # (one that does not exist was "not a directory" too, as if it were a file)
        what = "is a file" if os.path.exists(directory) else "does not exist"
        raise UserError(f"{directory} {what}; hf:DIR needs a Hugging Face model directory (config.json, weights, "
                        "tokenizer files)")  # fmt: skip
    return directory


# The model options a run may set apart from the weights it starts from: how it trains, and param_dtype (the
# weights' own storage unless chosen).
RUN_CHOICES = frozenset({*TRAINING_OPTIONS, "param_dtype", "scan_layers"})
# And the context and RoPE's frequencies, as a context extension sets them: RoPE's options (refused by lm.validation
# where the weights' positions are not RoPE), and the context where positions have no parameters (rope, sinusoidal,
# none; learned ones have a row per position, so theirs cannot grow).
CONTEXT = ("max_seq_len", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
           "rope_original_max_len")  # fmt: skip


def _free(trained: ModelConfig) -> frozenset[str]:
    """The model options a run from weights of model `trained` may set to other values than theirs."""
    return RUN_CHOICES | {name for name in CONTEXT if name != "max_seq_len" or trained.pos != "learned"}


def check_context(
    init_from: str, model: ModelConfig, trained: ModelConfig, chosen: Collection[str] | None = None
) -> None:
    """Refuse, in one line, a context extension of an hf:DIR model (`model`'s max_seq_len beyond the weights',
    `trained`) past where lm computes what transformers does with its config.json (hf.context_limit)."""
    if not init_from.startswith(HF_PREFIX) or model.max_seq_len <= trained.max_seq_len or trained.pos != "rope":
        return
    directory = hf_directory(init_from)
    rope_chosen = bool({"rope_scaling", "rope_theta"} & _chosen(model, "model", chosen))
    limit = hf.context_limit(hf.read_config(directory), rope_chosen)
    if limit is not None and model.max_seq_len > limit[0]:
        raise UserError(
            f"model.max_seq_len={model.max_seq_len} extends {directory}'s context past {limit[0]} tokens, where its "
            f"config.json has {limit[1]}; keep model.max_seq_len <= {limit[0]}"
        )


def _learned_context(requested: int, trained: int) -> str:
    """Why learned positions refuse another model.max_seq_len: a shorter one, too (their table keeps its rows), is
    what a shorter data.block_size trains."""
    if requested > trained:
        return "; learned positions have a row each, so their context cannot grow"
    return ("; learned positions have a row each, whose number stays: a shorter data.block_size alone trains a "
            "shorter context")


def inherit(
    requested: ModelConfig, trained: ModelConfig, chosen: Collection[str] | None = None, frozen: bool = False
) -> ModelConfig:
    """The model a run starting from `trained` weights builds: their architecture, with the run's training
    options (config.TRAINING_OPTIONS) and, where chosen, model.scan_layers (the layers stacked or not: the same
    weights, converted as they are loaded, in_layout). An architecture option the user chose with another value
    than the weights have is an error; one the user did not choose comes from the weights. model.param_dtype is the
    user's if chosen, else float32 for a run that trains the weights themselves (16-bit weights that Adam's
    small updates would round away: float32 master copies, as mixed precision keeps them), else (`frozen`: LoRA
    trains float32 adapters on them) the weights' own, bfloat16 for most open models, except float16, which lm
    never trains in (lm.validation).

    The context and RoPE's options (CONTEXT) are the user's where chosen and the weights' positions have no
    parameters, as a context extension sets them.

    `chosen` names the keys the user set (config.set_keys: the preset given and the overrides, e.g.
    "model.n_layer"); None takes the model options that differ from ModelConfig's defaults."""
    names = _chosen(requested, "model", chosen)
    free = _free(trained)
    differ = [
        f for f in dataclasses.fields(ModelConfig)
        if f.name in names and f.name not in free and getattr(requested, f.name) != getattr(trained, f.name)
    ]  # fmt: skip
    conflicts = [
        f"model.{f.name}={shown_value(getattr(requested, f.name))} (the weights have "
        f"{shown_value(getattr(trained, f.name))}"
        + (_learned_context(requested.max_seq_len, trained.max_seq_len) if f.name == "max_seq_len" else "")
        + ")"
        for f in differ
    ]
    if conflicts:
        fits = " ".join(f"model.{f.name}={shown_value(getattr(trained, f.name))}" for f in differ)
        raise UserError(
            f"init_from weights do not fit the requested model: {', '.join(conflicts)}; drop those model settings "
            f"(a preset's too: override them as {fits})"
        )
    if "param_dtype" in names:
        chosen_storage = {"param_dtype": requested.param_dtype}
    else:
        chosen_storage = {"param_dtype": "float32"} if trained.param_dtype == "float16" or not frozen else {}
    context = {name: getattr(requested, name) for name in CONTEXT if name in names and name in free}
    unscaled = trained.rope_scaling == "none" and "rope_original_max_len" not in names
    if context.get("rope_scaling") == "llama3" and unscaled:
        context["rope_original_max_len"] = trained.max_seq_len  # (llama3's is the context first trained at: theirs)
    if "scan_layers" in names:  # (a layout, not an architecture: the weights are stacked or split as it says)
        context["scan_layers"] = requested.scan_layers
    run = {name: getattr(requested, name) for name in TRAINING_OPTIONS}
    return dataclasses.replace(trained, **run, **chosen_storage, **context)
