"""Every choice lm makes per backend, decided here once per run from the backend and the shapes, and logged.

    p = platform.for_run(cfg, flops, rows)  # training: the backend's choices, the run's loss chunk and steps a call
    p = platform.of("gpu")                  # a backend's choices (what a Transformer uses when given none)
    print(p.describe())                     # the line a run logs at start

lm's model is written as the math (lm/model.py), in the formulation XLA fuses well on accelerators: flax's
norms differentiated by autodiff, matmuls over the activations as they are, a plain in-place cache write. A
backend departs from that only where a benchmark on that backend showed a faster formulation, and each
departure is a field below with the measurement that justifies it. Most are XLA:CPU's (we develop on a 2-core
CPU; benchmarks/README.md has the figures); a GPU departs in the loss, whose gradient is written out, whose
log-partition function is one pass over the logits, and whose logits are read in the head's 16-bit dtype, a
whole sequence of 1024 positions a chunk (each measured on an H100); TPUs keep every plain value until a
benchmark there (`python -m benchmarks.accelerator`) shows otherwise.

This module imports no JAX at the top: the command-line wrapper (lm.errors.cli) sets the host allocator
through it before JAX starts.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import sys
from typing import Any

# Host allocator settings (LM_MALLOC), set once per process before JAX starts (tune_host_allocator).
MALLOC_MODES = ("pad", "keep", "system")
malloc_mode = "system"  # what tune_host_allocator set


@dataclasses.dataclass(frozen=True)
class Platform:
    """How lm computes on one backend. Frozen and hashable: a Transformer carries it as a static attribute."""

    backend: str = "gpu"  # jax's platform name of the devices: cpu | gpu | tpu
    cuda: bool = False  # CUDA GPUs, where cuDNN's fused attention can run
    # lm.norm's LayerNorm/RMSNorm with the backward written out as matrix-vector products ("rowsums"), or flax's
    # nn.LayerNorm/nn.RMSNorm differentiated by autodiff ("autodiff"). XLA:CPU wrote autodiff's scale and row
    # statistics out at the activations' full size: rowsums took 1.1-2.8x PyTorch's LayerNorm time instead of
    # 4.3-7.8x (benchmarks/README.md, profile --peer).
    norm: str = "autodiff"
    # Every projection as one 2-D matmul over the flattened leading axes ("flat"), or a dot_general over the
    # activations as they are ("general"). XLA:CPU ran the backward pass of dots with extra free dimensions, or
    # with a transposed output layout, 2-3x slower.
    matmul: str = "general"
    # The fused query-key-value projection (model.fused_qkv) as one matmul whose output is sliced into queries,
    # keys and values ("fused"), or as three matmuls over slices of its kernel ("split"). On an H100 the slicing
    # was a copy of the whole output, 0.1 ms a layer of GPT-2 small's forward pass (and its backward's concatenation
    # again); three matmuls write each array whole, but on an H100 they trained GPT-2 small 0.988x as fast.
    qkv: str = "fused"
    # A cached call writes the new keys and values into the KV cache and attends over it ("plain"), or attends over
    # the old cache and the new keys apart and then writes, the write made to depend on that attention output
    # ("after_reads"). The plain way has fewer ops a token. XLA:CPU copied every layer's cache twice a token when it
    # was written first while the cache's slots came before its heads (2.5 of 24 ms at batch 1 for GPT-2 small);
    # with heads first both ways update in place there (tests/test_sampling.py), and the CPU keeps after_reads
    # until a quiet benchmark says which is faster (benchmarks.sample with LM_PLATFORM=cache_write=plain).
    cache_write: str = "plain"
    # Weights laid out for decoding (lm.sampling.layout): one row with every kernel transposed to [outputs,
    # inputs], several rows of a tied model with the head's own [D, V] copy. XLA:CPU streams a matrix-vector
    # product faster from rows of outputs: whole generate calls 1.05-1.08x faster (benchmarks.head_layout).
    decode_copies: bool = False
    # How attention runs for packed segments (fine-tuning examples, data.document_mask): the backend's kernel with a
    # [B, T, T] mask ("mask"; cuDNN's on CUDA GPUs, with the mask as a bias), or Pallas's fused flash attention
    # for GPUs, which takes the segment ids themselves ("pallas"). On an H100 the mask cost 1.063x the unmasked
    # GPT-2 small step, Pallas's kernel 1.21x.
    segments: str = "mask"
    # The fewest query positions in a block of lm.model.einsum_attention over a causal sequence (0 = all queries at
    # once): each block attends to the keys up to its own last position only, so the masked blocks above the
    # diagonal are never computed. One layer's attention forward and backward on a CPU (benchmarks.attention_blocks):
    # 1.24-1.38x faster at 256 positions in two blocks of 128, 1.75-1.83x at 1024 in four. Einsum attention runs
    # off a CPU only with attention dropout or model.attention=einsum.
    attention_block: int = 0
    # Greedy decoding's pick: "first_max" (a max, then the least index holding it) or jnp.argmax ("argmax").
    # XLA:CPU runs argmax as an unvectorised reduction of (value, index) pairs: 0.92 vs 0.25 ms for 8 rows of
    # GPT-2's logits.
    greedy: str = "argmax"
    # Positions of every row whose logits exist at once in the head and loss (lm/loss.py; 0 = all).
    # Chunks of 128 ran fastest of 64-512 on the CPU (benchmarks.loss_chunk) and bound the logits' memory on
    # any backend. A GPU takes 1024 (GPT-2 small's whole sequence, 3.3 GB of bfloat16 logits at 32 x 1024 tokens):
    # on an H100 1.012x the tokens/s of 128 with bfloat16 logits (fewer, larger kernels, and no sum of the head's
    # gradient over 8 chunks; benchmarks/results/h100/choices_loss_chunk_1024_over_logits_compute.json), less for
    # a larger batch or vocabulary (auto_loss_chunk).
    loss_chunk: int = 128
    # The loss's gradient with respect to the logits (lm.loss.token_losses): by autodiff ("autodiff"), or
    # written out as one elementwise pass that recomputes the softmax from the logits ("written"). Autodiff
    # keeps exp(logits) from the forward pass and adds the target's term by a scatter into a zero array of
    # the logits' size: on a CPU, where exp is the cost, it was faster (the head and loss of 8 x 1024 tokens of
    # GPT-2 small: 5.4 s against 6.0). On a GPU the passes over the logits are the cost: on an H100, GPT-2 small
    # (32 x 1024 tokens, bfloat16) trained 1.049x faster written (benchmarks/results/h100/choices.json), its loss's
    # kernels 8.8 ms a step instead of 13.1.
    loss_grad: str = "autodiff"
    # The loss's log-partition function: jax.nn.logsumexp's two passes over the float32 logits, their max and then
    # the sum of exp ("two_pass"), or one pass that carries both (lm.loss.online_logsumexp, "online"), with twice
    # the exps. On an H100 each pass over GPT-2 small's float32 logits took ~2.1 ms a step, and one pass trained
    # GPT-2 small 1.025x faster (over loss_grad=written; benchmarks/results/h100/choices_loss_grad_written.json).
    # A CPU, where exp is the cost, keeps two.
    log_z: str = "two_pass"
    # The dtype the chunked loss's logits are written in (lm.loss._chunk_logits; train.loss_chunk > 0): float32 out
    # of the head's matmul ("float32", the model's own head's accumulation), or rounded to the head's compute dtype
    # ("compute"), which each of the loss's passes upcasts as it reads: half the bytes a pass in a 16-bit model, the
    # rounding of PyTorch's autocast. On an H100 each pass over GPT-2 small's float32 logits took ~2.1 ms of a
    # ~69 ms step, the peer's over bfloat16 half that; "compute" trained it 1.026x faster there (2026-11-28,
    # benchmarks/results/h100/choices_logits_compute.json): a GPU's choice. A CPU, where bfloat16 arithmetic is
    # emulated, keeps float32. A float32 model: the same either way.
    logits: str = "float32"
    # The matmuls of Muon's Newton-Schulz iterations (lm.optim, optim.name=muon) on the float32 momentum: at the
    # precision JAX gives float32 ("default"), or with their inputs rounded to bfloat16 and float32 sums
    # ("bf16", jax.lax.DotAlgorithmPreset.BF16_BF16_F32; modded-nanogpt runs its iterations in bfloat16). On an
    # H200 Muon trained GPT-2 small at 0.83-0.86x AdamW's tokens/s with "default" (13.5 ms more a step for 1.6
    # TFLOP of iterations); "bf16" is not yet measured there, so no backend takes it by default. XLA:CPU
    # computes it in float32 (the same numbers, the same time). "bf16_iterations" runs the whole iterations on
    # bfloat16 arrays (lm.optim._iterated_in; the momentum stays float32): besides the matmuls' inputs, their
    # outputs and the elementwise steps between them, ~20 bytes an element of each matrix an iteration in float32
    # (a cast to bfloat16, the float32 output, the update read and written) against ~10, ~4 GB a step for GPT-2
    # small's 85M matrix elements over five iterations: ~1.6 ms at an H100's 2.67 TB/s, if XLA does not fuse the
    # casts away. A GPU's candidate, not yet timed; on the 2-core CPU, which emulates bfloat16, shakespeare_char
    # with Muon trained at 0.88x and 0.95x the tokens/s (two pairs side by side, a loaded hour, 2026-11-28).
    muon_matmul: str = "default"
    # How Muon's Newton-Schulz iterations take its matrices: one at a time ("matrix", optax's own), or stacked by
    # shape into batches ("shape", lm.optim._batched_by_shape): GPT-2 small's 48 matrices are then 4 batches, so
    # that each iteration is 4 batched matmuls of each kind, not 48 (each a GPU kernel). The update is the same
    # either way. On this 2-core CPU shakespeare_char with Muon trained at 26.5-28.6k tokens/s batched against
    # 20.8-22.2k (three rounds side by side, 2026-11-27): a CPU takes "shape"; not yet measured on a GPU.
    muon_batch: str = "matrix"
    # XLA_FLAGS' --xla_gpu_deterministic_ops: cuDNN's flash attention cannot then take its gradient (on an H100 with
    # jax 0.11.2, XLA's runtime stopped the program with `raw_hash_map<>::at`), so attention runs XLA's kernel. So
    # does --xla_gpu_exclude_nondeterministic_ops, which XLA takes as the same requirement of cuDNN's attention.
    deterministic_ops: bool = False
    # Optimizer steps per jitted call (a scan over that many batches).
    steps_per_call: int = 1
    # LM_MALLOC=keep on a CPU: each call waits for the one before, so that its temporaries reuse one heap block.
    one_call_at_a_time: bool = False

    @property
    def remat_saves_memory(self) -> bool:
        """Whether model.remat lowers a step's memory here: XLA:CPU folds the recomputation back into the forward
        pass (the same program and temporaries under none, full and dots), so a CPU is not told to set it."""
        return self.backend != "cpu"

    def describe(self) -> str:
        """One line for the run's log: what this backend computes how."""
        overridden = f" (LM_PLATFORM={os.environ['LM_PLATFORM']})" if os.environ.get("LM_PLATFORM") else ""
        logits = self.logits if self.loss_chunk else "float32"  # (unchunked, the model's own head writes them)
        return (
            f"platform {self.backend}{' (CUDA)' if self.cuda else ''}{overridden}: norms {self.norm}, "
            f"matmuls {self.matmul}, "
            f"qkv {self.qkv}, loss chunk {self.loss_chunk or 'off'}, loss gradient {self.loss_grad}, "
            f"log Z {self.log_z.replace('_', ' ')}, loss logits {logits}, "
            f"{self.steps_per_call} step{'s' if self.steps_per_call != 1 else ''} per call, KV cache write "
            f"{self.cache_write}, decoding copies {'on' if self.decode_copies else 'off'}, greedy {self.greedy}, "
            f"segments by {self.segments}, attention blocks {self.attention_block or 'off'}, "
            f"Muon matmuls {self.muon_matmul}, Muon batches by {self.muon_batch}, "
            f"{'deterministic ops (attention by XLA, not cuDNN), ' if self.deterministic_ops else ''}"
            f"host malloc {malloc_mode}"
        )


def _cpu() -> Platform:
    return Platform(
        backend="cpu",
        norm="rowsums",
        matmul="flat",
        cache_write="after_reads",
        decode_copies=True,
        greedy="first_max",
        attention_block=128,
        muon_batch="shape",
        one_call_at_a_time=malloc_mode == "keep",
    )


def _gpu(cuda: bool) -> Platform:
    ops = deterministic_ops()
    choices = dict(loss_grad="written", log_z="online", logits="compute", loss_chunk=1024)
    return Platform(backend="gpu", cuda=cuda, deterministic_ops=ops, **choices)


# The XLA_FLAGS either of which makes XLA require determinism of cuDNN's attention (its RequireDeterminism).
DETERMINISTIC_FLAGS = ("--xla_gpu_deterministic_ops", "--xla_gpu_exclude_nondeterministic_ops")


def deterministic_ops() -> bool:
    """Whether XLA_FLAGS asks XLA for deterministic GPU ops (DETERMINISTIC_FLAGS, each by its last setting)."""
    value = dict.fromkeys(DETERMINISTIC_FLAGS, False)
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, eq, setting = flag.partition("=")
        if name in value:
            value[name] = not eq or setting.lower() in ("true", "1")
    return any(value.values())


# The choices an environment may override (LM_PLATFORM), each with its values.
CHOICES = {
    "norm": ("rowsums", "autodiff"),
    "matmul": ("flat", "general"),
    "cache_write": ("after_reads", "plain"),
    "decode_copies": ("on", "off"),
    "greedy": ("first_max", "argmax"),
    "segments": ("mask", "pallas"),
    "attention_block": ("0", "32", "64", "128", "256"),
    "loss_grad": ("autodiff", "written"),
    "log_z": ("two_pass", "online"),
    "logits": ("float32", "compute"),
    "qkv": ("fused", "split"),
    "muon_matmul": ("default", "bf16", "bf16_iterations"),
    "muon_batch": ("matrix", "shape"),
}
# The jax.default_matmul_precision of each muon_matmul choice (None: JAX's own).
MUON_MATMUL_PRECISION = {"default": None, "bf16": "BF16_BF16_F32", "bf16_iterations": None}


def of(backend: str, cuda: bool = False) -> Platform:
    """The choices of a backend ('cpu', 'gpu', 'tpu', or any other JAX platform, which gets the plain ones), with
    the overrides of LM_PLATFORM (e.g. `LM_PLATFORM=norm=rowsums,matmul=flat`): what benchmarks.accelerator
    sets to time the other formulation of a choice on the backend it runs on. A bad override is a warning.
    LM_PLATFORM is read at each call (a later run in the same process takes the setting then), its choices made
    once a setting."""
    return _of(backend, cuda, os.environ.get("LM_PLATFORM", ""), malloc_mode)


@functools.lru_cache(maxsize=None)
def _of(backend: str, cuda: bool, setting: str, malloc: str) -> Platform:  # (malloc: _cpu's one_call_at_a_time)
    p = _cpu() if backend == "cpu" else _gpu(cuda) if backend == "gpu" else Platform(backend=backend, cuda=cuda)
    return dataclasses.replace(p, **_overrides(setting))


of.cache_clear = _of.cache_clear  # type: ignore[attr-defined]  # (tests start from a fresh cache)


def _overrides(setting: str) -> dict[str, Any]:
    chosen = {}
    for item in filter(None, (part.strip() for part in setting.split(","))):  # ("a=b, c=d" as written by hand)
        key, _, value = (part.strip() for part in item.partition("="))
        if value not in CHOICES.get(key, ()):
            options = "; ".join(f"{k}={'|'.join(v)}" for k, v in CHOICES.items())
            print(f"warning: LM_PLATFORM item {item!r} is not one of {options}; ignored", file=sys.stderr)
            continue
        chosen[key] = value == "on" if key == "decode_copies" else int(value) if key == "attention_block" else value
    return chosen


def current() -> Platform:
    """The choices of JAX's default backend."""
    import jax

    return _of_device(jax.devices()[0])


def of_arrays(tree: Any) -> Platform:
    """The choices of the backend that holds a tree's first array (numpy leaves: JAX's default backend)."""
    import jax

    leaves = jax.tree.leaves(tree)
    if leaves and isinstance(leaves[0], jax.Array):
        return _of_device(next(iter(leaves[0].devices())))
    return current()


def _of_device(device: Any) -> Platform:
    return of(device.platform, device.platform == "gpu" and "cuda" in device.client.platform_version.lower())


# Steps per call on a CPU, by a step's model FLOPs: a call takes the host's work (dispatch, batch placement,
# metrics; about 3 ms) and XLA:CPU's allocation of the step's temporaries once. Measured gains over one step per
# call (benchmarks/README.md): 1.37x at shakespeare_char (4e9 FLOPs a step, 10 steps a call), 1.21-1.30x at
# shakespeare_char_large (6e11, 5 a call). A step above 1e12 FLOPs takes seconds on a CPU: one a call, so that a
# signal is answered after one step.
_CPU_STEPS_PER_CALL = ((1e10, 10), (1e12, 5))


def steps_per_call(backend: str, flops_per_step: float) -> int:
    """Optimizer steps per jitted call when train.steps_per_call=0 (auto)."""
    if backend != "cpu":
        return 1  # no measurement on an accelerator yet shows a gain (benchmarks.accelerator measures it)
    return next((k for bound, k in _CPU_STEPS_PER_CALL if flops_per_step < bound), 1)


# The most bytes of one chunk's logits on a device (their gradient takes as many again) that the backend's own
# loss_chunk may hold: a GPU's 1024 positions were measured at GPT-2 small's 32 rows x 50,304 bfloat16 logits
# (3.3 GB); a larger batch or vocabulary halves the chunk until it fits, down to 128 positions.
LOSS_CHUNK_BYTES = 4 << 30


def auto_loss_chunk(p: Platform, rows: int, vocab: int, dtype: str) -> int:
    """Positions a chunk of the loss for `rows` sequences a device, a `vocab`-row head computed in `dtype`:
    the backend's loss_chunk, halved (to no less than 128) while the chunk's logits exceed LOSS_CHUNK_BYTES."""
    import jax.numpy as jnp

    itemsize = jnp.dtype(dtype).itemsize if p.logits == "compute" else 4
    chunk = p.loss_chunk
    while chunk > 128 and rows * chunk * vocab * itemsize > LOSS_CHUNK_BYTES:
        chunk //= 2
    return chunk


def for_run(cfg: Any, flops_per_step: float, rows_per_step: int) -> Platform:
    """The choices of the run configured by `cfg` (an lm.config.Config), whose optimizer step takes
    `flops_per_step` model FLOPs over `rows_per_step` sequences (lm.steps.rows_per_step), on JAX's default backend:
    the backend's, with train.loss_chunk and train.steps_per_call where they are set (not -1 and 0), the loss chunk
    within LOSS_CHUNK_BYTES where not."""
    import jax

    p = current()
    tc = cfg.train
    rows = -(-rows_per_step // (tc.grad_accum * jax.device_count()))  # a device's rows of a micro-batch
    chunk = auto_loss_chunk(p, rows, cfg.model.vocab_size, cfg.model.dtype) if tc.loss_chunk < 0 else tc.loss_chunk
    chunk = min(chunk, cfg.data.block_size)  # what the loss runs (a sequence is never more than one chunk), and logs
    per_call = tc.steps_per_call or steps_per_call(p.backend, flops_per_step)
    return dataclasses.replace(p, loss_chunk=chunk, steps_per_call=per_call)


def resolve(cfg: Any, flops_per_step: float, rows_per_step: int) -> Any:
    """`cfg` with train.loss_chunk and train.steps_per_call as the run's platform sets them (for_run)."""
    if cfg.train.loss_chunk >= 0 and cfg.train.steps_per_call:
        return cfg
    p = for_run(cfg, flops_per_step, rows_per_step)
    train = dataclasses.replace(cfg.train, loss_chunk=p.loss_chunk, steps_per_call=p.steps_per_call)
    return dataclasses.replace(cfg, train=train)


def attention_kernel(p: Platform, implementation: str, dtype: Any, segmented: bool = False) -> tuple[str, str]:
    """(kernel, why not cuDNN) for one attention call: kernel is 'cudnn' (cuDNN's fused flash attention through
    jax.nn.dot_product_attention), 'xla' (jax.nn.dot_product_attention's XLA implementation), 'einsum'
    (lm.model.einsum_attention, laid out heads first) or 'pallas' (Pallas's flash attention with segment ids),
    under model.attention = `implementation`, for a call with packed segments (`segmented`) or without.

    dot_product takes cuDNN on CUDA GPUs for bfloat16/float16 (segments as a mask), or Pallas's GPU kernel for
    segments where Platform.segments says so (on a GPU, or interpreted on a CPU; a TPU keeps the mask); else the
    backend's own: einsum on a CPU (its forward and backward took
    1.5-1.6x less time than jax's there, benchmarks/README.md), jax's XLA attention elsewhere. Any other
    `implementation` is taken as it is, with `why` cuDNN cannot run (for cudnn, which insists: the caller raises
    it)."""
    import jax.numpy as jnp

    why = ""
    if not p.cuda:
        why = f"it needs a CUDA GPU, and the devices here are {p.backend}"
    elif jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        why = f"it needs model.dtype=bfloat16 or float16, not {jnp.dtype(dtype).name}"
    elif p.deterministic_ops:
        why = f"XLA_FLAGS sets {' or '.join(DETERMINISTIC_FLAGS)}, under which its gradient does not run"
    if implementation != "dot_product":
        return implementation, why
    if segmented and p.segments == "pallas" and p.backend in ("gpu", "cpu"):  # (a CPU interprets it: the tests)
        return "pallas", why
    if not why:
        return "cudnn", ""
    return ("einsum" if p.backend == "cpu" else "xla"), why


def tune_host_allocator() -> None:
    """How glibc's malloc hands freed memory back to the system, from LM_MALLOC (benchmarks/README.md measures each);
    called by every command before JAX starts (a thread arena made before it would stay).

    XLA:CPU allocates a step's temporaries as one block and frees it at the end of the step; memory handed back is
    faulted in again by the next step (2-18 us a page here). `pad` (the default) keeps 1 GiB at the top of the heaps
    (M_TOP_PAD): enough for small models, and on a GPU or TPU host only 1 GiB kept. `keep` never hands memory back:
    one arena, no mmap'd blocks (a block over 32 MiB is otherwise always mmap'd, and unmapped when freed), no
    trimming; the process stays at its peak, which may reach about three times the step's temporaries, and a CPU
    run makes its calls one at a time (Platform.one_call_at_a_time). `system` leaves malloc alone."""
    global malloc_mode
    setting = os.environ.get("LM_MALLOC") or "pad"  # (set empty: as if unset)
    if setting not in MALLOC_MODES:
        print(
            f"warning: LM_MALLOC={setting!r} is not one of {', '.join(MALLOC_MODES)}; malloc left alone",
            file=sys.stderr,
        )
        return
    if setting == "system" or not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return
    mallopt(-2, 1 << 30)  # M_TOP_PAD
    if setting == "keep":
        mallopt(-8, 1)  # M_ARENA_MAX: every thread allocates from the main heap, which grows by brk, not mmap
        mallopt(-4, 0)  # M_MMAP_MAX: no block is mmap'd
    malloc_mode = setting  # (of() keys its choices by it: the CPU's one_call_at_a_time follows the setting)
