"""The device mesh and where every array lives on it.

Parameters carry logical axis names (see lm/model.py); RULES maps them onto the mesh axes
`data`, `fsdp` and `tensor`. FSDP shards the `embed` dimension of every parameter (and so of
the optimizer state) over `fsdp`; tensor parallelism shards heads, MLP width and vocabulary
over `tensor`; the batch is split over `data` and `fsdp` together.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import math
import os
import re
import shlex
import socket
import sys
import threading
import time
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lm.config import Config, DistributedConfig, MeshConfig
from lm.errors import UnjoinedError, UserError, first_line

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")
RULES = (
    # parameters
    ("batch", BATCH),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("layers", None),
    # activations: the batch stays split over data and fsdp; heads and MLP width over tensor
    ("act_batch", BATCH),
    ("act_len", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)

JAX_LATER_S = 60  # JAX's own wait to join is this much longer than distributed.initialization_timeout
JOIN_NOTE_S = 10  # how long a process waits for the job's others before it says so


# Environment variables that mark a multi-process job JAX can join on its own.
_CLUSTER_HINTS = {
    "JAX_COORDINATOR_ADDRESS": lambda v: bool(v),  # set by hand or by a launcher
    "SLURM_NTASKS": lambda v: v.isdigit() and int(v) > 1,
    "OMPI_COMM_WORLD_SIZE": lambda v: v.isdigit() and int(v) > 1,
    "TPU_WORKER_HOSTNAMES": lambda v: "," in v,  # a multi-host TPU slice
}
# What srun gives each task it starts, which JAX reads to join the job (an sbatch script's shell, the job's batch
# step, lacks SLURM_STEP_NODELIST; a shell of salloc lacks SLURM_PROCID and SLURM_LOCALID too)
_SLURM_TASK = ("SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
# The launchers that start every process of a job, as advice names them: the variable giving each process its rank
_RANKS = {"srun": "SLURM_PROCID", "mpirun": "OMPI_COMM_WORLD_RANK"}


def launcher() -> str | None:
    """The launcher that started this process as one of a multi-process job's: "srun" (a task of a SLURM job step)
    or "mpirun" (Open MPI); None for one started otherwise (alone, by hand, or an sbatch script's own shell)."""
    if _CLUSTER_HINTS["SLURM_NTASKS"](os.environ.get("SLURM_NTASKS", "")) and all(v in os.environ for v in _SLURM_TASK):
        return "srun"
    if _CLUSTER_HINTS["OMPI_COMM_WORLD_SIZE"](os.environ.get("OMPI_COMM_WORLD_SIZE", "")):
        return "mpirun"
    return None


def relaunch(command: str, dist: DistributedConfig) -> str:
    """How to start this job again with every process running `command` (train.py and a run's config.yaml, which
    holds no distributed settings): `command` for one process; under srun or mpirun, that launcher with the job's
    own options, as one command alone would start one process, not the job; else `command` on each process with
    the distributed settings it was given, each its own process_id."""
    settings = ""
    if dist.coordinator:
        waits = dist.initialization_timeout
        settings = (f" distributed.coordinator={dist.coordinator} distributed.num_processes={dist.num_processes}"
                    + (f" distributed.initialization_timeout={waits}"
                       if waits != DistributedConfig.initialization_timeout else ""))  # fmt: skip
    started_by = launcher()
    if started_by:
        if settings:  # (each process's id from the launcher, as lm's advice for a launcher JAX cannot read gives it)
            command = "sh -c " + shlex.quote(f"{command}{settings} distributed.process_id=${_RANKS[started_by]}")
        return (f"{started_by} ... {command} (with the {started_by} options that started this job, which start "
                "all its processes: the command alone would start one)")
    if settings:
        return (f"{command}{settings} distributed.process_id=ID (on each process, its ID from 0 to "
                f"{dist.num_processes - 1})")
    return command


def initialize(cfg: DistributedConfig) -> None:
    """Join a multi-process job with jax.distributed, when configured or when the cluster says so.

    Must run before anything else touches JAX devices. A single process needs nothing.
    """
    if jax.distributed.is_initialized():
        return
    hints = ", ".join(name for name, check in _CLUSTER_HINTS.items() if check(os.environ.get(name, "")))
    if not (cfg.coordinator or hints):
        return
    if not jax.config.jax_enable_preemption_service:
        raise UserError(
            "JAX's preemption service is off (JAX_ENABLE_PREEMPTION_SERVICE): a multi-process run needs it so that "
            "a SIGTERM to any process stops every process at the same step; unset it"
        )
    where = f"the job at distributed.coordinator={cfg.coordinator}" if cfg.coordinator else "the cluster's job"
    port = cfg.coordinator.rpartition(":")[2]
    if cfg.coordinator and cfg.process_id == 0 and not _can_listen(int(port)):
        # (JAX's coordination service, which process 0 runs there, crashed the process: SIGSEGV in jax 0.10)
        raise UserError(
            f"could not join {where}: process 0 cannot listen on port {port}, which another program holds; if that "
            "is another process of this job, also given distributed.process_id=0, give each process its own ID, else "
            "give every process another free port"
        )
    host = cfg.coordinator.rpartition(":")[0].strip("[]")
    if cfg.coordinator:
        try:
            socket.getaddrinfo(host, int(port))
        except socket.gaierror as e:
            if e.errno != socket.EAI_AGAIN:  # (not a name server slow to answer: JAX retries those)
                raise UserError(
                    f"could not join {where}: its host {host} is not known here ({e.strerror}); give process 0's "
                    "host name or IP address"
                ) from None
    args = (cfg.coordinator, cfg.num_processes, cfg.process_id) if cfg.coordinator else ()
    timeout = cfg.initialization_timeout
    try:
        # JAX's own timeout is later than ours: at its own, JAX aborts the process (SIGABRT, a C++ stack) instead of
        # raising, in jax 0.10 and 0.11 alike.
        join = functools.partial(jax.distributed.initialize, *args, initialization_timeout=timeout + JAX_LATER_S)
        said = f"waiting for the job's other processes to join {where} (up to {timeout:g} s: " \
               "distributed.initialization_timeout)"  # fmt: skip
        joined = _waiting_on_signals(join, timeout, said)
    except jax.errors.JaxRuntimeError as e:
        raise UserError(f"could not join {where}: {first_line(e)[:300]}") from None
    except (ValueError, RuntimeError) as e:
        # JAX found only part of the job in the environment (JAX_COORDINATOR_ADDRESS by hand, an sbatch script's
        # shell), or one it reads only with another package (JAX 0.11's Open MPI 5: a RuntimeError, without mpi4py)
        if cfg.coordinator or (isinstance(e, RuntimeError) and hints != "OMPI_COMM_WORLD_SIZE"):
            raise
        raise UserError(_unjoinable(hints, first_line(e))) from None
    if not joined:
        raise UnjoinedError(
            f"could not join {where}: not every process joined within {timeout} s (distributed.initialization_timeout)"
            "; start all of them with the same distributed.coordinator and num_processes (one that stopped on an "
            "error before it joined says why in its own output), check that each reaches process 0's HOST:PORT, "
            "or give them longer"
        )
    if launcher() == "srun" and not cfg.coordinator and jax.process_index() == 0:
        idle = idle_gpus(os.environ, jax.local_devices()[0].platform, jax.local_device_count())
        if idle:
            print(f"warning: {idle}", file=sys.stderr)


def idle_gpus(env, platform: str, local_devices: int) -> str | None:
    """A line where this node's tasks of a SLURM job step leave GPUs they see idle, else None. JAX gives each task
    of a SLURM job the one GPU its SLURM_LOCALID numbers (jax-ml/jax#16788), so a node with fewer tasks than GPUs
    (srun --ntasks-per-node=1 --gpus-per-node=8) trains on as many GPUs as it has tasks. The GPUs seen are
    CUDA_VISIBLE_DEVICES's (SLURM's GPUs of the step, where it binds none to a task), else SLURM_GPUS_ON_NODE; the
    node's tasks, SLURM_STEP_TASKS_PER_NODE ("8(x2),4": 8 on each of the step's first two nodes, 4 on the third)
    at its SLURM_NODEID. Where any is missing or unreadable, None: nothing is known to be idle."""
    if platform != "gpu" or local_devices != 1:
        return None
    visible, on_node = env.get("CUDA_VISIBLE_DEVICES"), env.get("SLURM_GPUS_ON_NODE", "")
    seen = len([d for d in visible.split(",") if d.strip()]) if visible else int(on_node) if on_node.isdigit() else 0
    counts = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")).split(","):
        each = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not each:
            return None
        counts += [int(each[1])] * int(each[2] or 1)
    node = env.get("SLURM_NODEID", "")
    tasks = counts[int(node)] if node.isdigit() and int(node) < len(counts) else 0  # (0: not known)
    if not 0 < tasks < seen:
        return None
    return (
        f"this node's {tasks} task{'s' if tasks > 1 else ''} of the SLURM job train on {tasks} of the {seen} GPUs "
        "the node gives them: JAX gives each task the one GPU its SLURM_LOCALID numbers; start one task per GPU "
        f"(srun --ntasks-per-node={seen} ...), and the mesh takes them all"
    )


def _unjoinable(hints: str, why: str) -> str:
    """The line for a job JAX found in the environment `hints` name but could not join (`why`, JAX's words): what
    starts its processes as JAX reads them, where lm knows the launcher, else JAX's reason and the settings."""
    unset = [v for v in _SLURM_TASK if v not in os.environ]
    if hints == "SLURM_NTASKS" and unset:
        # (an sbatch script's or salloc's own shell: JAX finds no task of the job, and would ask for a coordinator)
        return (
            f"this process is none of the {os.environ['SLURM_NTASKS']} tasks of its SLURM job ({', '.join(unset)} "
            "unset: the shell of an sbatch script or of salloc runs one process, not the job's tasks); start the "
            "command with srun, which starts the job's tasks: srun python train.py ... (or srun --ntasks=1 ... to "
            "train in one process)"
        )
    if hints == "OMPI_COMM_WORLD_SIZE":
        # (JAX reads Open MPI 4's OMPI_MCA_orte_hnp_uri; Open MPI 5's only from JAX 0.11 and with mpi4py)
        return (
            f"could not join the job of mpirun: {why[:200]}; give process 0's host as coordinator and each process's "
            "rank from mpirun: mpirun ... sh -c 'python train.py ... distributed.coordinator=HOST:PORT "
            "distributed.num_processes=$OMPI_COMM_WORLD_SIZE distributed.process_id=$OMPI_COMM_WORLD_RANK'"
        )
    return (
        f"could not join the cluster's job: {why[:300]} (from {hints}); give distributed.coordinator=HOST:PORT with "
        f"distributed.num_processes and distributed.process_id, or unset {hints}"
    )


def _can_listen(port: int) -> bool:
    """Whether a server could listen on `port` of every address of this host, as JAX's coordination service does
    ([::]:port): not if another program listens there (a socket of ours closed a moment ago does not count)."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((address, port))
                return True
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
    return True  # no address family to try: let JAX find out


_joining = False  # a process waiting for its peers (initialize): JAX must not be asked anything meanwhile


def joining() -> bool:
    """Whether this process was stopped while it waited to join its job: jax.process_index() and anything else
    that starts JAX's backends would then talk to a job half joined (and abort the process)."""
    return _joining


def _waiting_on_signals(fn, timeout: float, said: str = "") -> bool:
    """Whether fn() returned within `timeout` seconds: it runs in a thread of its own while this (the main) thread
    waits for it in short slices, so that a signal handler can run meanwhile: joining a job waits for every
    process inside a C++ call, which would hold a Ctrl-C or SIGTERM back until the peers came or the wait gave up.
    A wait given up leaves the thread waiting, and `joining()` true: the process can only exit. `said` is printed
    once the wait has taken JOIN_NOTE_S (a process started alone said nothing for its 300 s)."""
    failed: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as e:  # raised again in the caller's thread
            failed.append(e)

    global _joining
    thread = threading.Thread(target=run, name="lm: joining the job", daemon=True)
    _joining = True
    thread.start()
    started = time.monotonic()
    while thread.is_alive():
        if time.monotonic() > started + timeout:
            return False
        if said and time.monotonic() > started + JOIN_NOTE_S:
            print(said, file=sys.stderr, flush=True)
            said = ""
        thread.join(0.1)  # a signal's handler runs here, and what it raises leaves _joining set
    _joining = False
    if failed:
        raise failed[0]
    return True


def split_cpu(devices: int) -> None:
    """Give the CPU backend `devices` devices (mesh.cpu_devices), before JAX starts its backends.

    XLA:CPU runs a step's ops one after another, each mostly on one core; one device per core runs
    the data-parallel shards side by side instead (benchmarks/README.md measures it). GPUs and TPUs
    are unaffected. 0 leaves the count to XLA_FLAGS (1 by default), also after an earlier run in this process split
    it (a sweep's next run): refused where JAX already runs with that run's devices, which a fresh process lacks.
    """
    split = jax.config.jax_num_cpu_devices  # (-1: never set; else an earlier run's, in this process)
    if not devices and split < 0:
        return
    try:
        jax.config.update("jax_num_cpu_devices", devices or -1)
    except RuntimeError:  # JAX already has its devices (an earlier run in this process)
        if jax.local_devices()[0].platform != "cpu":  # (the split would not have applied)
            return
        if jax.local_device_count() != (devices or split):
            raise UserError(
                f"mesh.cpu_devices={devices} cannot take effect: JAX already runs with {jax.local_device_count()} "
                "CPU devices in this process; set it in a fresh process, or 0"
            ) from None
        if not devices and split > 1:
            raise UserError(
                f"mesh.cpu_devices=0 cannot take effect: an earlier run in this process split the CPU into {split} "
                f"devices, and JAX keeps them; set mesh.cpu_devices={split} here too, or train in a fresh process"
            ) from None


@contextlib.contextmanager
def activate(mesh: Mesh):
    """Trace inside this: the model's activation constraints then map onto `mesh` through RULES."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        yield


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over all devices; one axis may be -1 to take what is left."""
    devices = devices if devices is not None else jax.devices()
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    if sizes.count(-1) > 1:
        # (mesh.data is -1 by default: `mesh.fsdp=-1` alone asks for the rest twice)
        rest = [a for a, s in zip(AXES, sizes) if s == -1]
        keep = "fsdp" if "fsdp" in rest else rest[-1]
        default = " (mesh.data is -1 unless given)" if "data" in rest else ""
        raise UserError(
            f"{' and '.join(f'mesh.{a}=-1' for a in rest)} each take the remaining devices, and only one axis may"
            f"{default}; give all but one of them a size, e.g. "
            + " ".join(f"mesh.{a}={-1 if a == keep else 1}" for a in rest)
        )
    known = math.prod(s for s in sizes if s != -1)
    n = len(devices)
    there = f"there {'is' if n == 1 else 'are'} {n} device{'' if n == 1 else 's'}"
    # (on a CPU, devices are simulated: the fix may be to ask for as many as the axes take)
    cpu = devices[0].platform == "cpu"
    simulate = lambda wanted: f", or simulate {wanted} with mesh.cpu_devices={wanted}" if cpu else ""
    if -1 in sizes:
        if n % known:
            given = ", ".join(f"mesh.{a}={s}" for a, s in zip(("data", "fsdp", "tensor"), sizes))
            raise UserError(
                f"{given} need a multiple of {known} devices, and {there}; give axis sizes that divide "
                f"{n}{simulate(known)}"
            )
        sizes[sizes.index(-1)] = n // known
    if math.prod(sizes) != n:
        # (an axis can take the rest only where the others' product divides the devices)
        free = [a for i, a in enumerate(AXES) if n % math.prod(sizes[:i] + sizes[i + 1 :]) == 0]
        way = f"set mesh.{free[0]}=-1 to take the rest" if free else f"give axis sizes whose product is {n}"
        raise UserError(
            f"mesh data*fsdp*tensor = {'*'.join(map(str, sizes))} = {math.prod(sizes)} "
            f"but {there}; {way}{simulate(math.prod(sizes))}"
        )
    return jax.make_mesh(tuple(sizes), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)


def _fit(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """Drop mesh axes that do not divide their dimension (e.g. one K/V head over 4 tensor devices)."""
    fitted = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = math.prod(mesh.shape[a] for a in names)
        fitted.append(axes if names and dim % size == 0 else None)
    return P(*fitted)


def param_shardings(abstract_boxed_params: Any, mesh: Mesh) -> Any:
    """NamedShardings for the (unboxed) parameters, from their logical axis names."""
    logical = nn.get_partition_spec(abstract_boxed_params)
    mesh_specs = jax.tree.map(
        lambda s: nn.logical_to_mesh_axes(s, RULES), logical, is_leaf=lambda x: isinstance(x, P)
    )
    shapes = nn.unbox(abstract_boxed_params)
    return jax.tree.map(
        lambda spec, x: NamedSharding(mesh, _fit(spec, x.shape, mesh)),
        mesh_specs,
        shapes,
        is_leaf=lambda x: isinstance(x, P),
    )


def opt_state_shardings(abstract_opt_state: Any, params_sh: Any, mesh: Mesh) -> Any:
    """The optimizer state's shardings: an array that mirrors a parameter (a moment, Muon's momentum) lives where
    that parameter lives; counters and the rest are replicated.

    A mirror is found by its path, which ends in its parameter's path (mu['params']['h_0']...['kernel']), so
    that states which hold only some parameters (optax.partition's groups, masked elsewhere) are placed too."""
    by_path = {tuple(path): sh for path, sh in jax.tree_util.tree_flatten_with_path(params_sh)[0]}
    replicated = NamedSharding(mesh, P())

    def place(path, x):
        for start in range(len(path)):
            sh = by_path.get(tuple(path[start:]))
            if sh is not None and len(sh.spec) <= x.ndim:
                return sh
        return replicated

    return jax.tree_util.tree_map_with_path(place, abstract_opt_state)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, ...] array: rows split over the data and fsdp axes."""
    return NamedSharding(mesh, P(BATCH, *([None] * (ndim - 1))))


def batch_shards(mesh: Mesh) -> int:
    """The devices a batch's rows are split over (batch_sharding): the product of the BATCH axes' sizes."""
    return math.prod(mesh.shape[a] for a in BATCH)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def abstract_like(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree`'s arrays laid out as `shardings` say: what orbax restores into."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def bytes_per_device(abstract: Any, shardings: Any) -> int:
    """Bytes of a tree of abstract arrays (jax.ShapeDtypeStruct) that each device holds, laid out by `shardings`
    (a tree of the same structure): each leaf's shard."""
    sizes = jax.tree.map(lambda x, s: math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize, abstract, shardings)
    return sum(jax.tree.leaves(sizes))


def uneven_devices() -> str:
    """One line where the processes of a job hold different numbers of devices (a host given another
    --xla_force_host_platform_device_count, mesh.cpu_devices or CUDA_VISIBLE_DEVICES), else "": JAX's collectives
    between the processes (differing's) and lm's meshes take the same number on each."""
    counts = [0] * jax.process_count()
    for device in jax.devices():
        counts[device.process_index] += 1
    if len(set(counts)) <= 1:
        return ""
    held = ", ".join(f"process {p}: {n}" for p, n in enumerate(counts))
    return (
        f"the processes of this job hold different numbers of devices ({held}); give every process the same "
        "devices (the same XLA_FLAGS, mesh.cpu_devices, CUDA_VISIBLE_DEVICES or accelerators)"
    )


def differing(values: list) -> tuple[list[int], list[int]]:
    """This process's `values` (plain values: numbers, strings, lists of them; compared by a hash of their repr)
    against every other process's, in a collective every process enters: (the processes whose values differ from
    process 0's, the indices of the values that differ there)."""
    digest = lambda value: np.frombuffer(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), np.uint8)
    mine = np.stack([digest(value) for value in values])
    every = np.asarray(multihost_utils.process_allgather(mine))  # (processes, values, digest)
    differ = [p for p in range(len(every)) if not np.array_equal(every[p], every[0])]
    return differ, [i for i in range(len(values)) if any(not np.array_equal(every[p, i], every[0, i]) for p in differ)]


def spans_processes(mesh: Mesh | None) -> bool:
    """Whether `mesh` holds devices of other processes than this one (its calls then need same_on_every_process)."""
    return mesh is not None and any(d.process_index != jax.process_index() for d in mesh.devices.flat)


def same_on_every_process(mesh: Mesh | None, call: str, **arguments: Any) -> None:
    """Refuse, on every process at once and in the same line, a call of `call` whose `arguments` (plain values)
    differ between the processes that share `mesh`: each process would otherwise place its own rows into one
    batch (another process's temperature or prompts silently mixed into the result) or enter collectives of other
    shapes (a C++ abort). Nothing to compare within one process."""
    if not spans_processes(mesh):
        return
    processes, apart = differing(list(arguments.values()))
    if processes:
        names = [list(arguments)[i] for i in apart]
        raise UserError(
            f"{call} was called with other {', '.join(names)} on process{'es' if len(processes) > 1 else ''} "
            f"{', '.join(map(str, processes))} than on process 0; call it with the same arguments on every process of "
            "the job"
        )


def process_rows(mesh: Mesh, batch_size: int) -> np.ndarray:
    """The rows of each global batch that live on this process's devices, in order.

    make_array_from_process_local_data takes exactly these rows from each process; on most meshes
    they are one contiguous block, but a topology-aware device order may interleave processes.
    """
    indices = batch_sharding(mesh).addressable_devices_indices_map((batch_size,))
    rows = set()
    for (rows_slice,) in indices.values():
        rows.update(range(*rows_slice.indices(batch_size)))
    return np.array(sorted(rows), dtype=np.int64)


def global_batch(local: dict[str, np.ndarray], mesh: Mesh, batch_size: int) -> dict[str, jax.Array]:
    """Device arrays of the global batch of `batch_size` rows, from this process's rows of it (process_rows)."""
    shardings = {name: batch_sharding(mesh, x.ndim) for name, x in local.items()}
    if jax.process_count() == 1:  # every row is here: one transfer, without the multi-process bookkeeping
        return jax.device_put(local, shardings)
    return {
        name: jax.make_array_from_process_local_data(shardings[name], x, (batch_size, *x.shape[1:]))
        for name, x in local.items()
    }


def check(cfg: Config, mesh: Mesh) -> None:
    """Refuse a mesh the batch or the model cannot be split over, naming the sizes to change."""
    shards = batch_shards(mesh)
    micro = cfg.data.batch_size // cfg.train.grad_accum
    if micro % shards:
        # (a lower train.grad_accum is the fix where it, not the batch, left too few rows for the devices)
        what = "data.batch_size, train.grad_accum" if cfg.train.grad_accum > 1 else "data.batch_size"
        raise UserError(
            f"the micro-batch data.batch_size/train.grad_accum = {micro} must divide evenly over "
            f"mesh.data*mesh.fsdp = {shards} devices; change {what} or the mesh"
        )
    tensor, m = mesh.shape["tensor"], cfg.model
    # (a vocabulary the tensor axis does not divide stays whole on each device, as _fit places it: an imported
    # model's is its own, GPT-2's 50,257 divided by nothing from 2 to 8)
    # (the size named must divide both, and the devices it frees must go to an axis that takes the rest)
    fits = max(d for d in range(1, tensor + 1) if tensor % d == 0 and m.n_head % d == 0 and m.hidden % d == 0)
    rest = "" if -1 in (cfg.mesh.data, cfg.mesh.fsdp) else " mesh.data=-1"
    for name, size in (("model.n_head", m.n_head), ("the MLP width (model.mlp_hidden)", m.hidden)):
        if size % tensor:
            raise UserError(
                f"{name} = {size} cannot be split over mesh.tensor = {tensor}; set mesh.tensor={fits}{rest} (a size "
                f"that divides model.n_head = {m.n_head} and the MLP width = {m.hidden})"
            )
