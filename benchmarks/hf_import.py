"""Importing an open model: the load time and peak host memory of lm.pretrained.load("hf:DIR") against the
parameter bytes, on a random ~1B-parameter Llama written here in bfloat16 (as open models ship), in two
safetensors shards; beside transformers' AutoModelForCausalLM.from_pretrained of the same directory when
--hf-python names an interpreter that has torch and transformers (timed until every weight has been read:
from_pretrained alone may leave them mapped from the file, unread). Prints JSON and writes it to
benchmarks/results/hf_import.json.

    python -m benchmarks.hf_import [--layers 20] [--hf-python PATH] [--keep DIR]

Each load runs in a fresh process; memory is that process's peak resident set minus its resident set just
before the load (the imports), so it counts the loaded parameters themselves (on a CPU they live in host
memory) plus whatever the load needed on the way.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from benchmarks.report import command, positive, report
from lm.errors import UserError

CONFIG = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)

LM_LOAD = """
import json, sys, time
import jax
from lm import pretrained
def status(key):  # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's resident size at fork
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024
before = status("VmRSS")
started = time.perf_counter()
params, cfg, _ = pretrained.load("hf:" + sys.argv[1])
jax.block_until_ready(params)
seconds = time.perf_counter() - started
peak = status("VmHWM")
n = sum(x.size for x in jax.tree.leaves(params))
print(json.dumps({"seconds": seconds, "extra_bytes": peak - before, "params": n, "dtype": cfg.param_dtype}))
"""

HF_LOAD = """
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
def status(key):  # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's resident size at fork
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024
before = status("VmRSS")
started = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
lazy = time.perf_counter() - started
with torch.no_grad():  # weights mapped from the file are only read here
    total = sum(float(p.float().sum()) for p in model.parameters())
seconds = time.perf_counter() - started
peak = status("VmHWM")
print(json.dumps({"seconds": seconds, "seconds_from_pretrained_alone": lazy, "extra_bytes": peak - before,
                  "params": sum(p.numel() for p in model.parameters())}))
"""


def write_model(directory: str, layers: int) -> int:
    """A random Llama of `layers` layers in bfloat16, two shards with an index; returns the parameter count."""
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from safetensors.flax import save_file

    c = CONFIG
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    h = d // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * h
    rng = np.random.default_rng(0)

    def tensor(*shape, scale=0.02):
        return jnp.asarray((rng.standard_normal(shape, dtype=np.float32) * scale).astype(ml_dtypes.bfloat16))

    shards, total = [{}, {}], 0
    for i in range(layers):
        at = f"model.layers.{i}."
        shard = shards[i * 2 // layers]
        shard.update({
            at + "self_attn.q_proj.weight": tensor(d, d), at + "self_attn.k_proj.weight": tensor(kv, d),
            at + "self_attn.v_proj.weight": tensor(kv, d), at + "self_attn.o_proj.weight": tensor(d, d),
            at + "mlp.gate_proj.weight": tensor(f, d), at + "mlp.up_proj.weight": tensor(f, d),
            at + "mlp.down_proj.weight": tensor(d, f),
            at + "input_layernorm.weight": 1 + tensor(d), at + "post_attention_layernorm.weight": 1 + tensor(d),
        })
    shards[0]["model.embed_tokens.weight"] = tensor(v, d)
    shards[1]["model.norm.weight"] = 1 + tensor(d)
    shards[1]["lm_head.weight"] = tensor(v, d)
    weight_map = {}
    for k, shard in enumerate(shards):
        name = f"model-0000{k + 1}-of-00002.safetensors"
        save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
        total += sum(x.size for x in shard.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as out:
        json.dump({"metadata": {"total_size": total * 2}, "weight_map": weight_map}, out)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **c, "num_hidden_layers": layers,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    }
    with open(os.path.join(directory, "config.json"), "w") as out:
        json.dump(config, out)
    fixture = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "open_models", "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a small tokenizer: its ids fit the 32000 rows
        with open(os.path.join(fixture, name)) as src, open(os.path.join(directory, name), "w") as dst:
            dst.write(src.read())
    return total


def measure(python: str, code: str, directory: str) -> dict:
    done = subprocess.run([python, "-c", code, directory], capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if done.returncode:
        raise SystemExit(f"{python} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_hf_python(python: str) -> str:
    """The interpreter --hf-python names, if it runs and has torch and transformers (asked without importing them);
    else a UserError, before the model is written."""
    found = shutil.which(python)
    if found is None:
        raise UserError(f"--hf-python {python}: no such program; give a Python that has torch and transformers "
                        "(a virtual environment's bin/python)")  # fmt: skip
    ask = "import importlib.util as u; print(*[m for m in ('torch', 'transformers') if u.find_spec(m) is None])"
    try:
        done = subprocess.run([found, "-c", ask], capture_output=True, text=True, timeout=120)
    except OSError as e:
        raise UserError(f"--hf-python {python} does not run: {e.strerror}; give a Python that has torch and "
                        "transformers") from None  # fmt: skip
    if done.returncode:
        said = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise UserError(f"--hf-python {python} is not a Python that runs this ({said[:200]}); give one that has torch "
                        "and transformers")  # fmt: skip
    if done.stdout.split():
        raise UserError(f"--hf-python {python} has no {' or '.join(done.stdout.split())}; install them there "
                        "(pip install torch transformers) or give another Python")  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=positive, default=20, help="Llama layers (20: about 1.03B parameters)")
    parser.add_argument("--hf-python", help="a Python with torch and transformers, to load the same directory")
    parser.add_argument("--keep", help="write the model here and keep it (default: a temporary directory)")
    args = parser.parse_args()
    hf_python = check_hf_python(args.hf_python) if args.hf_python else None
    if args.keep and os.path.exists(args.keep) and not os.path.isdir(args.keep):
        raise UserError(f"--keep {args.keep} exists and is not a directory; give a directory to write the model in")
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.keep or tmp
        os.makedirs(directory, exist_ok=True)
        n = write_model(directory, args.layers)
        os.sync()  # the 2 GB just written are on disk before anything is timed
        param_bytes = 2 * n
        result = {"params": n, "param_bytes": param_bytes, "dtype": "bfloat16", "cpus": os.cpu_count()}
        lm = measure(sys.executable, LM_LOAD, directory)
        result["lm"] = {**lm, "extra_x_param_bytes": round(lm["extra_bytes"] / param_bytes, 3)}
        if hf_python:
            theirs = measure(hf_python, HF_LOAD, directory)
            result["transformers"] = {**theirs, "extra_x_param_bytes": round(theirs["extra_bytes"] / param_bytes, 3)}
            result["load_time_lm_over_transformers"] = round(lm["seconds"] / theirs["seconds"], 2)
    report("hf_import", result)


if __name__ == "__main__":
    command(main)
