"""The parameters a decoding loop reads: the weights laid out for it, made once per set of parameters.

What changes (lm.model has each transformation):
    scan_layers    the stacked blocks split into h_0 ... h_{L-1} (unscanned): inside a scan over layers
                   XLA copies each layer's weights out of the stack at every step
    one row        where the parameters' platform asks for decoding copies (lm.platform: a CPU), every Linear
                   kernel transposed, [outputs, inputs] (outputs_first): a one-row step is a chain of
                   matrix-vector products, which XLA:CPU streams faster from rows of outputs: GPT-2 small's
                   decoding loop ran 1.1x faster, whole generate calls 1.05-1.07x (benchmarks.head_layout)
    rows           there too, a tied head's own [D, V] copy of the token embedding (untied): XLA:CPU multiplies
                   a few rows by a [D, V] weight faster than by the [V, D] embedding (1.02-1.07x at batch 4-8)

The copies cost memory (the kernels' size again, or the embedding's), so they are made only while
they take under a quarter of the memory free; and time (0.14 s for GPT-2 small's kernels, 0.4 s the
first time in a process, which compiles the transposes: what one to three hundred tokens gain), so
the latest set made is kept while the parameters it was made from live, and a later call with the same
arrays (jax Arrays are immutable: the same arrays, the same weights), the same model config and one row
or several alike reuses it. Parameters with numpy leaves are converted every call.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Any

import jax

from lm import platform
from lm.config import ModelConfig
from lm.model import outputs_first, unscanned, untied


@dataclasses.dataclass
class _Made:
    sources: list[weakref.ref]  # the leaves of the parameters it was made from
    key: tuple[ModelConfig, bool]  # (their model config, several rows)
    treedef: Any
    leaves: list[Any]  # per leaf: ("source", i) for the i-th source leaf, else ("new", array)
    cfg: ModelConfig


_latest: _Made | None = None


def for_decoding(params: Any, model_cfg: ModelConfig, rows: int) -> tuple[Any, ModelConfig]:
    """(the parameters, the model config) to decode `rows` rows with: the same model, laid out for it."""
    global _latest
    leaves = jax.tree.leaves(params)
    key = (model_cfg, rows > 1)
    made = _latest
    if made is not None and made.key == key and _same(made.sources, leaves):
        kept = [leaves[x] if kind == "source" else x for kind, x in made.leaves]
        return jax.tree.unflatten(made.treedef, kept), made.cfg
    new_params, new_cfg = _make(params, model_cfg, rows)
    if leaves and all(isinstance(x, jax.Array) for x in leaves):
        index = {id(x): i for i, x in enumerate(leaves)}
        new_leaves, treedef = jax.tree.flatten(new_params)
        kept = [("source", index[id(x)]) if id(x) in index else ("new", x) for x in new_leaves]
        _latest = _Made([weakref.ref(x) for x in leaves], key, treedef, kept, new_cfg)
        # Dropped with the parameters it was made from, not held until the next call.
        weakref.finalize(leaves[0], _forget, weakref.ref(_latest))
    return new_params, new_cfg


def forget() -> None:
    """Drop the kept set (its memory is freed once no decoding holds it)."""
    global _latest
    _latest = None


def _forget(made: weakref.ref) -> None:
    if _latest is not None and made() is _latest:
        forget()


def _same(sources: list[weakref.ref], leaves: list[Any]) -> bool:
    return len(sources) == len(leaves) and all(ref() is x for ref, x in zip(sources, leaves))


def _make(params: Any, model_cfg: ModelConfig, rows: int) -> tuple[Any, ModelConfig]:
    params, model_cfg = unscanned(params, model_cfg)
    if not platform.of_arrays(params).decode_copies:
        return params, model_cfg
    p = params["params"]
    first = jax.tree.leaves(p)[0]
    # (numpy: put there)
    device = next(iter(first.devices())) if isinstance(first, jax.Array) else jax.local_devices()[0]
    if rows > 1:
        if model_cfg.tie_embeddings and _fits(p["wte"]["embedding"].nbytes, device):
            return untied(params, model_cfg)
        return params, model_cfg
    kernels = [x for path, x in jax.tree_util.tree_leaves_with_path(p) if path[-1].key == "kernel"]
    if _fits(sum(x.nbytes for x in kernels), device):
        return outputs_first(params, model_cfg), model_cfg
    return params, model_cfg


def _fits(nbytes: int, device) -> bool:
    """Whether a copy of `nbytes` takes under a quarter of the memory free where the parameters are: the device's
    (its allocator's limit less what is in use), the host's for a CPU, 4 GiB where that is unknown."""
    stats = (device.memory_stats() or {}) if device.platform != "cpu" else {}
    if stats.get("bytes_limit"):
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if device.platform == "cpu" else 4 * 2**30
        except (ValueError, OSError, AttributeError):
            free = 4 * 2**30
    return nbytes < free / 4
