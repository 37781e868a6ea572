"""LoRA: low-rank adapters on the model's projection kernels, as pure functions over parameter pytrees.

    adapters = init_adapters(params, rank=8, targets=("qkv", "attn_proj"), rng=jax.random.key(0))
    merged = merge(params, adapters, alpha=16.0, rank=8)      # W + alpha/rank * A @ B on every target
    logits = Transformer(cfg).apply(merged, tokens_BT)

Fine-tuning differentiates the loss of `merge(params, adapters, ...)` with respect to the adapters only, so
the base parameters stay as they are and the optimizer state covers the adapters alone.

Targets name kernels by their place in lm.model:
    qkv        attention's Q/K/V projections: the fused one (model.fused_qkv=true), or else the three
               separate ones (imported Llama-family models have them), so the default targets suit both
    q, k, v    attention's separate projections (fused_qkv=false)
    attn_proj  attention's output projection
    fc         the relu/gelu MLP's input projection
    gate, up   the SwiGLU MLP's two input projections
    mlp_proj   the MLP's output projection

A kernel of shape [*in, *out] (e.g. qkv [D, K, G+2, H], attn_proj [N, H, D]) gets A [prod(in), rank] and
B [rank, prod(out)], with delta = (A @ B) reshaped to the kernel's shape. Under model.scan_layers the kernels
carry a leading layer axis, and so do A [L, in, rank] and B [L, rank, out]. A starts normal with standard
deviation 1/sqrt(in) (so A's output keeps the input's scale), B at zero, so training starts from the base
model exactly. Adapters are float32 whatever the parameters' dtype (merged kernels: see merge), and mirror the
parameters' nesting: adapters[...]["h_0"]["attn"]["qkv"] = {"a": A, "b": B} for
params[...]["h_0"]["attn"]["qkv"]["kernel"].
Parameters are plain (unboxed) arrays, as in the train state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from lm.errors import UserError

# target -> (parent module, module, kernel axes that are inputs)
TARGETS = {
    "qkv": ("attn", "qkv", 1),
    "q": ("attn", "q", 1),
    "k": ("attn", "k", 1),
    "v": ("attn", "v", 1),
    "attn_proj": ("attn", "proj", 2),
    "fc": ("mlp", "fc", 1),
    "gate": ("mlp", "gate", 1),
    "up": ("mlp", "up", 1),
    "mlp_proj": ("mlp", "proj", 1),
}
SCANNED_BLOCKS = "h"  # the module name of the stacked blocks under scan_layers


def _kernels(params: Any) -> dict[tuple[str, ...], tuple[str, int, bool]]:
    """{path of a target module: (target, input axes, stacked over layers)} for every targetable kernel."""
    by_place = {(parent, module): name for name, (parent, module, _) in TARGETS.items()}
    found = {}
    for path in traverse_util.flatten_dict(params):
        if len(path) >= 4 and path[-1] == "kernel" and (path[-3], path[-2]) in by_place:
            name = by_place[path[-3], path[-2]]
            found[path[:-1]] = (name, TARGETS[name][2], path[-4] == SCANNED_BLOCKS)
    return found


def target_names_problem(targets: Sequence[str]) -> str:
    """What is wrong with the names of LoRA `targets` whatever the model, in a line ("" if nothing)."""
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        what = f"unknown LoRA target(s) {', '.join(unknown)}" if unknown else "no LoRA targets given"
        return f"{what}; choose from {', '.join(TARGETS)}"
    return ""


def init_adapters(params: Any, rank: int, targets: Sequence[str], rng: jax.Array) -> Any:
    """Fresh adapters (A random, B zero) of `rank` for the target kernels of `params`."""
    if problem := target_names_problem(targets):
        raise UserError(problem)
    if rank < 1:
        raise UserError(f"LoRA rank must be >= 1, got {rank}")
    kernels = _kernels(params)
    present = sorted({name for name, _, _ in kernels.values()}, key=list(TARGETS).index)
    if "qkv" in targets and "qkv" not in present and {"q", "k", "v"} <= set(present):
        targets = [*(t for t in targets if t != "qkv"), "q", "k", "v"]
    missing = [t for t in targets if t not in present]
    if missing:
        raise UserError(
            f"LoRA target(s) {', '.join(missing)} match no weights of this model; it has {', '.join(present)}"
        )
    flat = traverse_util.flatten_dict(params)
    adapters = {}
    sides = {}  # each targeted kernel's (fan_in, fan_out), less a scanned stack's leading axis
    for path, (name, n_in, stacked) in kernels.items():
        shape = flat[path + ("kernel",)].shape[1 if stacked else 0 :]
        if name in targets:
            sides[path] = (math.prod(shape[:n_in]), math.prod(shape[n_in:]))
    smallest = min(min(side) for side in sides.values())
    if rank > smallest:  # (A @ B's rank is at most that: more adapter weights, no more that they can learn)
        raise UserError(
            f"lora.rank={rank} is more than the smallest side of the weights it adapts ({smallest}), which bounds "
            f"an adapter's rank; choose lora.rank <= {smallest}"
        )
    for i, (path, (name, n_in, stacked)) in enumerate(sorted(kernels.items())):
        if name not in targets:
            continue
        shape = flat[path + ("kernel",)].shape
        lead = shape[:1] if stacked else ()
        fan_in, fan_out = sides[path]
        a = jax.random.normal(jax.random.fold_in(rng, i), (*lead, fan_in, rank), jnp.float32) / math.sqrt(fan_in)
        adapters[path + ("a",)] = a
        adapters[path + ("b",)] = jnp.zeros((*lead, rank, fan_out), jnp.float32)
    return traverse_util.unflatten_dict(adapters)


def merge(params: Any, adapters: Any, alpha: float, rank: int, dtype: Any = jnp.float32) -> Any:
    """params with W + (alpha / rank) * A @ B in place of every adapted kernel W; pure and jit-friendly.

    The sum is float32 and the merged kernel keeps the wider of W's dtype and `dtype`, the model's compute dtype
    (model.dtype), which the model casts it to anyway: a 16-bit base under float32 compute is merged in float32.
    (Rounded back to the base's bfloat16, an adapter's change below a weight's rounding step, which early LoRA
    changes often are, was lost: the model trained and sampled without most of what the adapters learned.)"""
    flat = traverse_util.flatten_dict(params)
    flat_adapters = traverse_util.flatten_dict(adapters)
    scale = alpha / rank
    for path, a in flat_adapters.items():
        if path[-1] != "a":
            continue
        module = path[:-1]
        kernel_path = module + ("kernel",)
        if kernel_path not in flat:
            raise UserError(f"LoRA adapters for {'/'.join(module)} do not fit these parameters; use the base model")
        if a.shape[-1] != rank:
            raise UserError(f"LoRA adapters have rank {a.shape[-1]}, not {rank}; use the rank they were trained with")
        w = flat[kernel_path]
        delta = jnp.matmul(a, flat_adapters[module + ("b",)]).reshape(w.shape)
        flat[kernel_path] = (w.astype(jnp.float32) + scale * delta).astype(jnp.promote_types(w.dtype, dtype))
    return traverse_util.unflatten_dict(flat)
