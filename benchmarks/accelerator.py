"""Every accelerator figure in one command: what a session lent a GPU runs first (about 8 minutes on one H100).

    python -m benchmarks.accelerator [--budget 480] [--fixture] [--parts peak train profile decode choices]
        [--choices NAME ...]

In order, each part in its own processes, each until the budget (seconds, for the whole command) runs out; a
part that would start past it is skipped and listed as such:

    peak      matmul FLOP/s (float32, bfloat16) and memory bandwidth (benchmarks.peak, n=8192, 2 GB)
    train     GPT-2 small with its real vocabulary shape (model.vocab_size=50304, bfloat16, 32 x 1024 tokens a step)
              against the torch.compile peer, 2 rounds side by side (benchmarks.versus_torch --compile)
    profile   lm's and the peer's kernel time by part of the model (benchmarks.profile --peer --compile)
    decode    GPT-2 small's batch-1 and batch-8 decoding against the bandwidth bound, float32 and bfloat16
              (benchmarks.sample; the bound is the parameters' bytes over the read bandwidth of `peak`), then again
              with XLA's command buffers (CUDA graphs) for while loops, which it leaves out by default
    choices   the same shape once with document masks (data.document_mask=true: their cost over the unmasked
              step, as a mask to cuDNN and through Pallas's kernel) and once for each other formulation of
              lm.platform's choices on this backend (LM_PLATFORM overrides, train.loss_chunk,
              train.steps_per_call), as tokens/s over the platform's own choice in the same part: what
              lm/platform.py's table for this backend should say. It runs last, one run each on what the budget
              leaves, so that it cannot crowd out the parts above; --choices NAME ... times only those of CHOICES
              (a run starts only with 60 s of the budget left, and a fresh machine's first takes ~70 s)

Results go to benchmarks/results/<device>/ (e.g. benchmarks/results/h100/): each part's JSON, and summary.json
and summary.md, the table of the headline figures. --fixture also writes a small piece of the recorded trace
(the first kernels of lm's profiled steps, and the HLO instructions they name) to tests/fixtures/gpu_trace/,
which tests/test_benchmarks.py reads. On a GPU machine without lm's dependencies installed, see
../shared/device/README.md for running it from a checkout.

--set KEY=VALUE changes the GPT-2 runs' shape, for a rehearsal of the whole command on a CPU before a device
session (about 8 minutes on the 2-core development machine; its figures mean nothing, and --fixture keeps the
recorded GPU trace when lm's trace has no GPU kernels):

    LM_BENCH_RESULTS=/tmp/rehearsal python -m benchmarks.accelerator --budget 590 --steps 30 --fixture \\
        --parts train profile decode choices --set model.n_layer=1 model.n_embd=64 model.n_head=2 \\
        data.batch_size=2 data.block_size=128 model.max_seq_len=128
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import time

from benchmarks.report import RESULTS, command, positive, positive_float, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# GPT-2 small as the issue measures it: the real vocabulary's shape with the bytes tokenizer (no download),
# one micro-batch of 32 x 1024 tokens, logged every 10 steps.
GPT2 = ["data.tokenizer=bytes", "model.vocab_size=50304", "data.batch_size=32", "train.grad_accum=1", "train.log_every=10"]
# The other formulation of each of lm.platform's choices, as (name, lm override) pairs; an upper-case override
# is an environment variable (benchmarks.versus_torch.run_lm).
# Those not yet measured on the device come first (on a GPU, loss_grad=autodiff is the other formulation since
# 2026-11-27's measurement made written the GPU's own; on a CPU, written). Muon's rows are over AdamW's step:
# what its iterations cost at the platform's precision, with their matmuls' inputs in bfloat16, and with the
# matrices of a shape orthogonalised as one batch.
CHOICES = [
    # Muon's cost over AdamW (issue 37's goal: >= 0.9x its tokens/s): the candidate first, then the H100's 0.89x
    ("optim=muon, muon_matmul=bf16_iterations, muon_batch=shape", ["optim.name=muon", "LM_PLATFORM=muon_matmul=bf16_iterations,muon_batch=shape"]),
    ("optim=muon", ["optim.name=muon"]),
    ("optim=muon, muon_matmul=bf16", ["optim.name=muon", "LM_PLATFORM=muon_matmul=bf16"]),
    ("optim=muon, muon_batch=shape", ["optim.name=muon", "LM_PLATFORM=muon_batch=shape"]),
    ("optim=muon, muon_matmul=bf16, muon_batch=shape", ["optim.name=muon", "LM_PLATFORM=muon_matmul=bf16,muon_batch=shape"]),
    ("log_z=online", ["LM_PLATFORM=log_z=online"]),
    ("document_mask", ["data.document_mask=true"]),  # the cost of document masks (target <= 1.15x the step)
    ("document_mask, segments=pallas", ["data.document_mask=true", "LM_PLATFORM=segments=pallas"]),
    ("norm=rowsums", ["LM_PLATFORM=norm=rowsums"]),
    ("loss_grad=autodiff", ["LM_PLATFORM=loss_grad=autodiff"]),
    ("loss_grad=written", ["LM_PLATFORM=loss_grad=written"]),
    ("qkv=split", ["LM_PLATFORM=qkv=split"]),
    # cuBLASLt's epilogues: a matmul's bias (and GELU) added as it writes its output, not in a pass of their own.
    ("XLA cuBLASLt", ["XLA_FLAGS=--xla_gpu_enable_cublaslt=true"]),
    ("loss_chunk=512", ["train.loss_chunk=512"]),
    ("steps_per_call=4", ["train.steps_per_call=4"]),
    ("matmul=flat", ["LM_PLATFORM=matmul=flat"]),
    ("loss_chunk=0", ["train.loss_chunk=0"]),
    # The chunked loss's logits in float32 and in chunks of 128 positions, as a GPU took them before 2026-11-28's
    # H100 measurement (bfloat16 logits 1.026x, then one chunk of 1024 1.012x); a CPU's other formulation.
    ("logits=float32", ["LM_PLATFORM=logits=float32"]),
    ("logits=compute", ["LM_PLATFORM=logits=compute"]),
    ("loss_chunk=128", ["train.loss_chunk=128"]),
]
# XLA's CUDA graphs for the decoding loop's body too (while loops are not captured by default): fewer launches.
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
PARTS = ("peak", "train", "profile", "decode", "choices")


def device_dir() -> str:
    """benchmarks/results/<short name of this device>, e.g. h100."""
    import jax

    kind = jax.devices()[0].device_kind.lower()
    known = re.search(r"\b(h100|h200|gh200|a100|b200|l4|l40s|v4|v5e|v5p|v5 lite|v6e|v6 lite)\b", kind)
    name = known.group(1) if known else kind
    return os.path.join(RESULTS, re.sub(r"[^a-z0-9]+", "_", name).strip("_"))


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run(module: str, args: list[str], out_dir: str, budget: Budget, env: dict | None = None) -> bool:
    """python -m module args, writing its results into out_dir, within what is left of the budget."""
    env = {**os.environ, "LM_BENCH_RESULTS": out_dir, **(env or {})}
    try:
        done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, timeout=max(budget.left(), 1))
    except subprocess.TimeoutExpired:
        print(f"accelerator: {module} ran out of the budget", file=sys.stderr)
        return False
    return done.returncode == 0


def choices(out_dir: str, budget: Budget, steps: int, shape: list[str] = GPT2, only: list[str] | None = None) -> dict:
    """tokens/s of each other formulation over the platform's own, GPT-2 small, one run each, within the budget;
    a run that fails (a kernel that cannot take the shape, say) or runs out of the budget is recorded as such and
    the rest go on. `only`: these of CHOICES' names (all when None)."""
    from benchmarks.versus_torch import run_lm

    rates, failed = {}, {}
    for name, overrides in [("platform", []), *(c for c in CHOICES if only is None or c[0] in only)]:
        rates[name] = None  # not measured: out of budget, or failed
        if budget.left() < 60:
            continue
        try:
            rates[name] = statistics.median(run_lm("gpt2_small", steps, [*shape, *overrides], timeout=budget.left())[1:])
        except subprocess.CalledProcessError as e:
            failed[name] = f"exit code {e.returncode}"
        except subprocess.TimeoutExpired:
            failed[name] = "ran out of the budget"
        except statistics.StatisticsError:
            failed[name] = f"no tokens/s logged after the first interval in {steps} steps"
    base = rates["platform"]
    result = {
        "steps": steps,
        "tokens_per_sec": {k: round(v) if v else None for k, v in rates.items()},
        "over_platform": {k: round(v / base, 3) if v and base else None for k, v in rates.items() if k != "platform"},
        "failed": failed,
    }
    report("choices", result, os.path.join(out_dir, "choices.json"))
    return result


def decode(out_dir: str, budget: Budget) -> bool:
    """benchmarks.sample for GPT-2 small (float32 and bfloat16, batch 1 and 8), then again with command buffers."""
    args = ["--models", "gpt2-small (", "gpt2-small, bfloat16", "--batches", "1", "8", "--no-recompute", "--quick"]
    ok = run("benchmarks.sample", args, out_dir, budget)
    if budget.left() > 60:
        flags = f"{os.environ.get('XLA_FLAGS', '')} {COMMAND_BUFFERS}".strip()
        out = os.path.join(out_dir, "sample_command_buffers.json")
        run("benchmarks.sample", [*args, "--out", out], out_dir, budget, {"XLA_FLAGS": flags})
    return ok


def write_fixture(out_dir: str, kernels: int = 120) -> None:
    """The first `kernels` kernels of lm's profiled trace, its metadata rows, and the instructions they name."""
    with open(os.path.join(out_dir, "profile_gpt2_small.json")) as f:
        trace_path = json.load(f)["lm"]["trace"]
    with gzip.open(trace_path, "rt") as f:
        trace = json.load(f)
    with open(os.path.join(os.path.dirname(trace_path), "ops.json")) as f:
        ops = json.load(f)
    from benchmarks.profile import gpu_kernels, launched_by

    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kept = sorted(gpu_kernels(events), key=lambda e: e["ts"])[:kernels]
    if not kept:  # a CPU run (a rehearsal): the recorded GPU fixture stays as it is
        print("accelerator: no GPU kernels in lm's trace; tests/fixtures/gpu_trace/ is left as it is", file=sys.stderr)
        return
    rows = {(e["pid"], e["tid"]) for e in kept}
    meta = [e for e in events if e.get("ph") == "M" and (e.get("name") == "process_name" or (e["pid"], e.get("tid")) in rows)]
    target = os.path.join(ROOT, "tests", "fixtures", "gpu_trace")
    os.makedirs(target, exist_ok=True)
    with gzip.open(os.path.join(target, "perfetto_trace.json.gz"), "wt") as f:
        json.dump({"traceEvents": meta + kept}, f)
    named = set()
    for e in kept:  # the instruction each kernel names, and the command buffer it ran in
        named |= {launched_by(e, ops), launched_by({"name": e.get("args", {}).get("hlo_op", "")}, ops)}
    with open(os.path.join(target, "ops.json"), "w") as f:
        json.dump({k: v for k, v in ops.items() if k in named}, f, indent=1)


def summary(out_dir: str, skipped: list[str]) -> dict:
    """The headline figures of the parts' JSON files, as a dict and a Markdown table."""

    def load(name):
        try:
            with open(os.path.join(out_dir, f"{name}.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    rows = []
    peak = load("peak")
    if peak:
        rows += [("bfloat16 matmul peak", f"{peak['bfloat16_flops'] / 1e12:.0f} TFLOP/s"),
                 ("read bandwidth", f"{peak['read_bytes_per_sec'] / 1e12:.2f} TB/s")]  # fmt: skip
    train = load("versus_torch_cuda_gpt2") or load("versus_torch_gpt2")  # the peer on a GPU, or on a TPU host's CPU
    if train:
        entry = train["presets"]["gpt2_small"]
        rows += [("GPT-2 small, lm tokens/s", f"{entry['lm']['median']:,}"),
                 ("GPT-2 small, torch.compile tokens/s", f"{entry['peer_median']:,}"),
                 ("lm / torch.compile", f"{entry['lm']['ratio_to_peer']:.3f} (target >= 1.05)")]  # fmt: skip
    chosen = load("choices")
    if chosen:
        rows += [(f"tokens/s with {k}, over the platform's own", "not measured" if v is None else f"{v:.3f}")
                 for k, v in chosen["over_platform"].items()]  # fmt: skip
        if chosen["over_platform"].get("document_mask"):
            rows.append(("document-masked step / unmasked", f"{1 / chosen['over_platform']['document_mask']:.3f} (target <= 1.15)"))
    prof = load("profile_gpt2_small")
    if prof and "peer" in prof:
        for part, ms in prof["lm"]["parts_ms_per_step"].items():
            rows.append((f"kernel ms/step, {part} (lm / peer)", f"{ms} / {prof['peer']['parts_ms_per_step'][part]}"))
    for name, label in (("sample", ""), ("sample_command_buffers", ", command buffers")):
        for r in (load(name) or {}).get("runs", []):
            rows.append((f"decode {r['model']}, batch {r['batch']}{label}", f"{r['cached']['loop_ms_per_step']} ms a step, "
                         f"{r['loop_step_over_bound']}x the bound (target <= 2 at batch 1)"))  # fmt: skip
    rows += [(f"{part}", "skipped: out of budget or failed") for part in skipped]
    table = "| figure | value |\n| --- | --- |\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(table)
    print(table)
    return {"figures": dict(rows), "skipped": skipped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=positive_float, default=480, help="seconds for the whole command (480)")
    parser.add_argument("--steps", type=positive, default=50, help="train steps of each GPT-2 small run (50)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--fixture", action="store_true", help="also write tests/fixtures/gpu_trace/ from the profile")
    parser.add_argument("--choices", nargs="+", choices=[name for name, _ in CHOICES], metavar="NAME",
                        help="the choices part times these of CHOICES only (all by default), beside the platform")  # fmt: skip
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="change the GPT-2 runs' shape (a rehearsal on a CPU at a small one)")  # fmt: skip
    args = parser.parse_args()
    shape = [*GPT2, *args.set]
    from benchmarks.versus_torch import run_steps  # enough logged intervals to time, refused here if not
    from lm import config as config_lib
    from lm.errors import UserError

    try:
        cfg = config_lib.load("gpt2_small", shape)
    except UserError as e:  # a bad --set, before anything runs
        parser.error(f"--set: {e}")
    run_steps("gpt2_small", cfg, args.steps)
    budget = Budget(args.budget)
    out_dir = device_dir()
    os.makedirs(out_dir, exist_ok=True)
    steps = str(args.steps)
    commands = {
        "peak": ("benchmarks.peak", ["--n", "8192", "--mb", "2048"]),
        "train": ("benchmarks.versus_torch", ["--presets", "gpt2_small", "--rounds", "2", "--steps", steps, "--compile",
                                              "--name", "gpt2", *shape]),
        "profile": ("benchmarks.profile", ["--preset", "gpt2_small", "--steps", "5", "--peer", "--compile", *shape]),
    }  # fmt: skip
    skipped = []
    for part in args.parts:
        if budget.left() < 30:
            skipped.append(part)
            continue
        if part == "choices":
            choices(out_dir, budget, args.steps, shape, args.choices)
            continue
        if part == "decode":
            if not decode(out_dir, budget):
                skipped.append(part)
            continue
        module, part_args = commands[part]
        if not run(module, part_args, out_dir, budget):
            skipped.append(part)
        elif part == "profile" and args.fixture:
            write_fixture(out_dir)
    report("summary", summary(out_dir, skipped), os.path.join(out_dir, "summary.json"))


if __name__ == "__main__":
    command(main)
