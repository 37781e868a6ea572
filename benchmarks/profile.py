"""Where a train step's time goes, op by op, in lm and (with --peer) in the PyTorch peer on the same shape.

    python -m benchmarks.profile [--preset shakespeare_char] [--steps 10] [--peer] [key=value ...]

lm: the preset's jitted train step on a random batch under `jax.profiler.trace` (kept in --trace-dir for
Perfetto or TensorBoard), with the allocator setting that train.py uses (LM_MALLOC). Every XLA op event is
summed twice: by its name without the trailing number (`ynn_fusion.12` -> `ynn_fusion`, the YNNPACK
fusions on CPU), and by the part of the model it computes, read from the compiled HLO: the op's
`op_name` metadata names the Flax module (`.../h_3/attn/qkv/dot_general`; `transpose(jvp(...))` for the
backward pass) and its fused computation says whether it is a matmul.

--peer: benchmarks/peer.py trains the same shape in a fresh process under `torch.profiler` and its aten
ops' self times are summed into the same parts, so the two columns compare like with like:

    matmul       the projections' and the head's matmuls, forward and backward
    attention    scores, mask, softmax and the weighted sum (PyTorch: its fused SDPA kernel)
    layernorm    the LayerNorms and their gradients
    elementwise  GELU, biases, residual adds, dropout and their gradients
    embedding    token and position lookups and their scatter-add gradients
    loss         log-softmax and cross-entropy and their gradients
    optimizer    the gradient clip and AdamW
    copies       layout copies and transposes on their own
    other        the rest (PyTorch: the autograd engine's own time)

Op times add up over threads: XLA:CPU runs up to one op per core at a time, PyTorch one op at a time
split over its threads. Prints JSON and writes benchmarks/results/profile_<preset>.json.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import numpy as np

from benchmarks.report import command, need, positive, report
from lm import config as config_lib
from lm import errors, platform, sharding
from lm.model import flops_per_token
from lm.optim import make_optimizer
from lm.steps import create_state, make_train_step

PARTS = ("matmul", "attention", "layernorm", "elementwise", "embedding", "loss", "optimizer", "copies", "other")
LAYOUT_OPCODES = {"copy", "transpose", "bitcast", "reshape", "parameter"}


def hlo_ops(text: str) -> dict[str, tuple[str, set[str]]]:
    """Every instruction of an HLO module's text: name -> (op_name metadata, opcodes it runs, a fusion's inside)."""
    opcodes: dict[str, set[str]] = {}  # computation -> the opcodes in it
    op_names: dict[str, str] = {}  # computation -> its root's op_name (XLA's wrapped ops carry none outside)
    instructions: dict[str, tuple[str, str, str]] = {}  # name -> (opcode, called computation, op_name)
    current = ""
    for line in text.splitlines():
        header = re.match(r"(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header and not line.startswith(" "):
            current = header.group(1)
            opcodes[current] = set()
            continue
        m = re.match(r"\s+(ROOT )?%?([\w.\-]+) = (.*)", line)
        if not m or not current:
            continue
        opcode = re.search(r"([a-z][\w\-]*)\(", m.group(3))
        opcode = opcode.group(1) if opcode else ""
        opcodes[current].add(opcode)
        calls = re.search(r"calls=%?([\w.\-]+)", m.group(3))
        op_name = re.search(r'op_name="([^"]*)"', m.group(3))
        op_name = op_name.group(1) if op_name else ""
        if m.group(1):
            op_names[current] = op_name
        instructions[m.group(2)] = (opcode, calls.group(1) if calls else "", op_name)
    return {
        name: (op_name or op_names.get(called, ""), opcodes.get(called, set()) if opcode == "fusion" else {opcode})
        for name, (opcode, called, op_name) in instructions.items()
    }


def lm_part(op_name: str, opcodes: set[str]) -> str:
    """Which part of the model an XLA op of the train step computes (see the module docstring)."""
    is_dot = bool(opcodes & {"dot", "convolution"})
    if opcodes and opcodes <= LAYOUT_OPCODES and opcodes & {"copy", "transpose"}:
        return "copies"
    if "Transformer" not in op_name:
        if "while/body" in op_name or re.search(r"jvp\(\)", op_name):
            return "matmul" if is_dot else "loss"  # the head and the loss, in chunks (lm.loss)
        return "optimizer" if op_name.startswith("jit(") else "other"
    if re.search(r"/(attn/(qkv|proj|q|kv|o)|mlp/\w+)/", op_name):
        return "matmul" if is_dot else "elementwise"  # a projection, or its bias
    if "/attn/" in op_name:
        return "attention"
    if re.search(r"/(ln\w*|norm\w*)/", op_name):
        return "layernorm"
    if re.search(r"/(jit\(_take\)|wte|wpe)", op_name):
        return "embedding"
    return "matmul" if is_dot else "elementwise"


def torch_part(op: str) -> str:
    """Which part of the model a PyTorch op of the peer's step computes."""
    op = op.removeprefix("aten::")
    if op in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear"):
        return "matmul"
    if "scaled_dot_product" in op or "softmax" in op and "log" not in op:
        return "attention"
    if "layer_norm" in op:
        return "layernorm"
    if "embedding" in op or op in ("index_select", "index_add_", "index_put_", "arange"):
        return "embedding"
    if "log_softmax" in op or "nll_loss" in op or "cross_entropy" in op:
        return "loss"
    if op.startswith(("_foreach", "_fused_adam")) or "norm" in op or op.startswith(("Optimizer", "zero_")):
        return "optimizer"
    if op in ("copy_", "clone", "contiguous", "transpose", "t", "permute", "view", "reshape", "_unsafe_view"):
        return "copies"
    if op.startswith(("autograd::", "torch::autograd", "Autograd", "ProfilerStep")):
        return "other"
    return "elementwise"


def profile_lm(cfg, steps: int, trace_dir: str) -> dict:
    vocab = 256 if cfg.data.tokenizer == "bytes" else 50304
    cfg = dataclasses.replace(cfg, model=config_lib.resolve_model(cfg.model, vocab, cfg.data.block_size))
    mesh = sharding.make_mesh(cfg.mesh)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    state, _ = create_state(cfg, tx, mesh)
    shape = (cfg.data.batch_size, cfg.data.block_size)
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, vocab, shape).astype(np.int32) for k in ("inputs", "targets")}
    step = jax.jit(make_train_step(cfg, tx), donate_argnums=0)
    with sharding.activate(mesh):
        ops = hlo_ops(step.lower(state, batch).compile().as_text())
        state, metrics = step(state, batch)  # compiles
        jax.block_until_ready(metrics)
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(steps):
                state, metrics = step(state, batch)
                if platform.malloc_mode == "keep":  # as lm.loop runs CPU steps with LM_MALLOC=keep
                    jax.block_until_ready(metrics)
            jax.block_until_ready(metrics)
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    with open(os.path.join(os.path.dirname(path), "ops.json"), "w") as f:  # the trace's key (accelerator --fixture)
        json.dump({name: [op_name, sorted(opcodes)] for name, (op_name, opcodes) in ops.items()}, f)
    flops = flops_per_token(cfg.model, cfg.data.block_size) * shape[0] * shape[1]
    return {
        "trace": path,
        **summarize_trace(trace, ops, steps),
        "model_gflop_per_step": round(flops / 1e9, 3),
        "malloc": platform.malloc_mode,
    }


GEMM_KERNELS = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|Cijk", re.I)  # cuBLAS's and cuBLASLt's kernel names
ATTENTION_KERNELS = re.compile(r"cudnn|fmha|flash", re.I)  # cuDNN's fused attention


def gpu_kernels(events: list[dict]) -> list[dict]:
    """The kernel events of a jax.profiler trace taken on GPUs: complete ('X') events on the rows of a GPU's
    streams (process '/device:GPU:N', thread 'Stream #...'); the host's rows and the device's summary rows
    ('XLA Ops', 'XLA Modules', 'Steps', ...) repeat the same time and are left out."""
    gpus = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and str(e.get("args", {}).get("name", "")).startswith("/device:GPU:")}  # fmt: skip
    streams = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e.get("pid") in gpus and str(e.get("args", {}).get("name", "")).startswith("Stream #")}  # fmt: skip
    return [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams]


def launched_by(kernel: dict, ops: dict) -> str:
    """The HLO instruction of `ops` that launched a GPU kernel, or "". XLA names a fusion's kernel after its
    instruction with the name's dots made underscores (`input_add_reduce_fusion.36` ->
    `input_add_reduce_fusion_36`), and so the trace's hlo_op: the instruction itself, or, for a kernel that XLA
    runs inside a command buffer (a CUDA graph, as most of a train step's are), the command buffer's call. So
    the kernel's own name is read first."""
    for name in (kernel["name"], kernel.get("args", {}).get("hlo_op", "")):
        for candidate in (name, re.sub(r"_(\d+)$", r".\1", name)):
            if candidate in ops:
                return candidate
    return ""


def kernel_part(kernel: dict, ops: dict) -> str:
    """The part of the model a GPU kernel computes: a library's kernel by its name (cuBLAS's GEMMs, which XLA
    launches from custom calls, and cuDNN's attention), a memset or memcpy as a copy, any other by the HLO
    instruction that launched it (launched_by, read in the compiled step as on a CPU)."""
    if GEMM_KERNELS.search(kernel["name"]):
        return "matmul"
    if ATTENTION_KERNELS.search(kernel["name"]):
        return "attention"
    if kernel["name"].startswith(("Memset", "Memcpy")):
        return "copies"
    op = launched_by(kernel, ops)
    return lm_part(*ops[op]) if op else "other"


def summarize_trace(trace, ops: dict, steps: int) -> dict:
    """Time by kind of op and by part of the model, per step, from a trace of `steps` train steps: XLA:CPU's op
    events, or on GPUs the kernels on the device's streams (kinds: kernel names without their numbers)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kinds, parts, instructions = collections.Counter(), collections.Counter(), collections.Counter()
    kernels = gpu_kernels(events)
    if kernels:
        for k in kernels:
            kinds[re.sub(r"[._]\d+$", "", k["name"])] += k.get("dur", 0)
            parts[kernel_part(k, ops)] += k.get("dur", 0)
            instructions[launched_by({"name": k["name"]}, ops) or k["name"]] += k.get("dur", 0)  # not the graph's
        span_us = max(k["ts"] + k.get("dur", 0) for k in kernels) - min(k["ts"] for k in kernels)
        timing = {"device": "gpu", "step_ms": round(span_us / steps / 1e3, 2)}  # first kernel to last
    else:
        wall_us = 0.0
        for event in events:
            if event.get("ph") != "X":
                continue
            name, us = event["name"], event.get("dur", 0)
            if name == "ThunkExecutor::Execute (wait for completion)":
                wall_us += us
            if name not in ops:  # the runtime's and the host's own events, not XLA ops
                continue
            kinds[re.sub(r"\.\d+$", "", name)] += us
            parts[lm_part(*ops[name])] += us
            instructions[name] += us
        timing = {"device": "cpu", "step_ms": round(wall_us / steps / 1e3, 2)}
    op_us = sum(kinds.values())
    return {
        **timing,
        "op_ms_per_step": round(op_us / steps / 1e3, 2),  # summed over threads (CPU) or streams (GPU)
        "parts_ms_per_step": {p: round(parts[p] / steps / 1e3, 2) for p in PARTS},
        "ops": {
            kind: {"ms_per_step": round(us / steps / 1e3, 3), "share": round(us / op_us, 3)}
            for kind, us in kinds.most_common(15)
        },
        # The costliest instructions (a library's kernels by their own name), with what they compute: the Flax
        # module and the op of their op_name metadata, and a fusion's opcodes. What a change to the model targets.
        "instructions": {
            name: {
                "ms_per_step": round(us / steps / 1e3, 3),
                "op_name": ops[name][0][-160:] if name in ops else "",
                "opcodes": sorted(ops[name][1]) if name in ops else [],
            }
            for name, us in instructions.most_common(40)
        },
    }


def torch_kernel_part(kernel: str) -> str:
    """Which part of the model a CUDA kernel of the peer's step computes, by its name: cuBLAS GEMMs, the fused
    attention kernels, and the Triton kernels torch.compile names after the ops it fused."""
    name = kernel.lower()
    if GEMM_KERNELS.search(name):
        return "matmul"
    if ATTENTION_KERNELS.search(name) or "attention" in name:
        return "attention"
    if "layer_norm" in name:
        return "layernorm"
    if "embedding" in name:
        return "embedding"
    if "log_softmax" in name or "nll_loss" in name or "cross_entropy" in name:
        return "loss"
    if "adam" in name or "foreach" in name or "norm" in name:
        return "optimizer"
    if "copy" in name or "clone" in name or "cat" in name.split("_"):
        return "copies"
    return "elementwise"


def profile_peer(cfg, steps: int, compile_: bool = False) -> dict:
    from benchmarks.versus_torch import ROOT, peer_settings

    settings = {**peer_settings(cfg, steps + 3, compile_), "log_every": steps + 3, "profile": steps}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.peer", json.dumps(settings)],
        check=True, cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    peer = json.loads(out.stdout.strip().splitlines()[-1])
    on_gpu = "kernels_ms_per_step" in peer  # on a GPU its kernels' time, else its CPU ops' self time
    times = peer["kernels_ms_per_step" if on_gpu else "ops_ms_per_step"]
    parts = collections.Counter()
    for op, ms in times.items():
        parts[torch_kernel_part(op) if on_gpu else torch_part(op)] += ms
    top = sorted(times.items(), key=lambda kv: -kv[1])[:15]
    return {
        "device": "gpu" if on_gpu else "cpu",
        "step_ms": round(peer["profiled_step_ms"], 2),
        "op_ms_per_step": round(sum(times.values()), 2),  # self times (CPU) or kernel times (GPU)
        "parts_ms_per_step": {p: round(parts[p], 2) for p in PARTS},
        "ops": {op: round(ms, 3) for op, ms in top},
        "threads": peer["threads"],
        "torch": peer["torch"],
        "compiled": compile_,
    }


@errors.cli
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="shakespeare_char")
    parser.add_argument("--steps", type=positive, default=10)
    parser.add_argument("--peer", action="store_true", help="also profile the PyTorch peer (the bench extra)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the peer (as on a GPU); needs --peer")
    parser.add_argument("--trace-dir", default=os.path.join(tempfile.gettempdir(), "lm-profile"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.compile and not args.peer:
        raise errors.UserError("--compile torch.compiles the peer, and there is none without --peer: give --peer too")
    cfg = config_lib.load(args.preset, args.overrides)
    if args.peer:
        need("torch")  # before lm's profile, not after it
    result = {"preset": args.preset, "overrides": args.overrides, "steps": args.steps}
    result["lm"] = profile_lm(cfg, args.steps, args.trace_dir)
    if args.peer:
        result["peer"] = profile_peer(cfg, args.steps, args.compile)
        lm_parts, peer_parts = result["lm"]["parts_ms_per_step"], result["peer"]["parts_ms_per_step"]
        result["lm_over_peer"] = {p: round(lm_parts[p] / peer_parts[p], 2) if peer_parts[p] else None for p in PARTS}
        result["lm_over_peer"]["step"] = round(result["lm"]["step_ms"] / result["peer"]["step_ms"], 2)
    result.update(device=jax.devices()[0].device_kind, jax=jax.__version__)
    report(f"profile_{args.preset}", result)


if __name__ == "__main__":
    sys.exit(command(main))
