"""Reading and writing Hugging Face model directories: config.json, safetensors weights (one file or shards)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import json
import os
import re
import shutil
import sys
import tempfile

import jax
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from lm.errors import UserError, first_line
from lm.files import why_not_made, write_json
from lm import storage
from lm.storage import cut_name


def read_config(directory: str) -> dict:
    """config.json of a model directory, as a dict."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        inside = [os.path.join(directory, name) for name in ("checkpoints", "params")]  # a run, a step
        if os.path.basename(os.path.normpath(directory)) == "checkpoints":  # (RUN/checkpoints: RUN without hf:)
            inside.append(directory)
        if any(os.path.isdir(held) for held in inside):
            # an lm run or checkpoint step given as hf:DIR: say to drop the prefix, as checkpoint.py says to add it
            raise UserError(f"{directory} holds lm's checkpoints, not a model in Hugging Face format; give it "
                            "without hf:") from None  # fmt: skip
        raise UserError(f"{directory} has no config.json; give a Hugging Face model directory") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 (byte {e.start}); give the model's config.json as UTF-8 JSON") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a JSON object; give a Hugging Face model directory")
    quantization = config.get("quantization_config")
    if quantization is not None:  # its weights are integers or float8 with scales beside them: numbers lm would misread
        method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else quantization
        raise UserError(f"{path} describes quantized weights (quantization_config: {method}), which lm does not read; "
                        "give the model's float32, bfloat16 or float16 weights")  # fmt: skip
    return config


INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 << 30  # an export's weights above this go into several files, as save_pretrained's default
DAMAGED = "it is damaged or incomplete (a partial download?): copy or download the model's files again"
STORED_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}  # safetensors' names
# Buffers that older files store beside the weights, which hold no weights (RoPE's frequencies, GPT-2's causal masks)
BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


class Weights:
    """The tensors of a model directory's safetensors files (model.safetensors, else the shards an index names),
    read one at a time and as stored (bfloat16 too), so the host never holds them all at once. Names lose a
    "transformer." prefix (GPT-2's save_pretrained writes one)."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, INDEX)
        # model.safetensors first, as transformers reads a directory holding both it and an index
        if os.path.isfile(index) and not os.path.isfile(os.path.join(directory, "model.safetensors")):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except OSError as e:
                raise UserError(f"cannot read {index}: {e.strerror or e}") from None
            except (ValueError, KeyError, TypeError) as e:  # (not JSON, or no weight_map: cut short, or another file)
                raise UserError(f"cannot read {index}: {e}; {DAMAGED}") from None
        else:
            with self._file("model.safetensors") as f:
                weight_map = {name: "model.safetensors" for name in f.keys()}
        self._where = {name.removeprefix("transformer."): (name, file) for name, file in weight_map.items()}
        self.read: set[str] = set()  # the tensors read so far (warn_unread)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self.array(name))

    def array(self, name: str) -> jax.Array:
        """A tensor on JAX's CPU device, as stored (numpy's safetensors reader has no bfloat16)."""
        full, file = self._where[name]
        self.read.add(name)
        try:
            # Opened for each tensor: a file left open keeps every page read from it mapped (resident).
            with self._file(file) as f, jax.default_device(jax.local_devices(backend="cpu")[0]):
                stored = f.get_slice(full).get_dtype()
                if stored not in STORED_DTYPES:  # int8 or float8 (quantized), ...: not numbers of the model as read
                    raise UserError(f"{full} in {os.path.join(self.directory, file)} is stored as {stored}, not as "
                                    "floating-point numbers (quantized?); lm reads float32, bfloat16 or float16 "
                                    "weights")  # fmt: skip
                return f.get_tensor(full)
        except (SafetensorError, ValueError, TypeError) as e:
            raise UserError(f"cannot read {full} from {os.path.join(self.directory, file)}: {e}") from None

    def get(self, name: str, default=None):
        return self[name] if name in self else default

    def warn_unread(self) -> None:
        """Once a model is read: warn of the tensors it left out (not buffers), which config.json does not describe
        (a layer past its num_hidden_layers, a bias it has no place for). transformers leaves them out too, with a
        report; lm's model ran without them and said nothing."""
        unread = sorted(name for name in self._where if name not in self.read and not ("." + name).endswith(BUFFERS))
        if unread:
            shown = ", ".join(unread[:3]) + (f" and {len(unread) - 3} more" if len(unread) > 3 else "")
            print(f"warning: {self.directory}'s weights hold {len(unread)} tensor{'s' * (len(unread) > 1)} that its "
                  f"config.json gives no place in the model, which lm leaves out ({shown}); if config.json is not "
                  "this model's own, copy the model's", file=sys.stderr)  # fmt: skip

    def dtype(self, name: str) -> str:
        """The dtype a tensor is stored in (float32, bfloat16, float16, ...), without reading it."""
        full, file = self._where[name]
        with self._file(file) as f:
            stored = f.get_slice(full).get_dtype()
        return STORED_DTYPES.get(stored, stored.lower())

    def _file(self, file: str):
        path = os.path.join(self.directory, file)
        if not os.path.isfile(path):
            if os.path.isfile(os.path.join(self.directory, INDEX)):  # (a partial download)
                raise UserError(f"{self.directory} has no {file}, which its {INDEX} names; copy or download every "
                                "shard the index lists")  # fmt: skip
            raise UserError(
                f"{self.directory} has no {file}; lm reads weights in safetensors format only (never pickled .bin "
                "files)"
            )
        try:
            return safe_open(path, framework="flax")
        except SafetensorError as e:  # (its header: a file cut short, or none of safetensors)
            raise UserError(f"cannot read {path}: {e}; {DAMAGED}") from None
        except OSError as e:
            raise UserError(f"cannot read {path}: {e}") from None


@contextlib.contextmanager
def new_directory(out_dir: str):
    """A directory to write an export into, renamed to out_dir once the export is written whole (where out_dir is an
    empty directory already: made inside it, its files renamed into it, config.json last); refuses a file or a
    directory with anything in it at out_dir (a half-overwritten model directory is worse than none). An export
    that fails (a full disk) leaves nothing, and says so in one line. An out_dir in object storage (s3://, gs://) is
    written locally, then uploaded (_uploaded)."""
    check_new_directory(out_dir)
    if storage.is_url(out_dir):
        yield from _uploaded(out_dir)
        return
    # An empty directory that is there already (made by the user, a volume mounted into a container, a link to one,
    # the working directory ".") is written into, not replaced: renaming over it failed ("Device or resource busy"
    # for a mount point or ".", "Not a directory" for a link), and replaced its owner, group and mode otherwise.
    existing = os.path.isdir(out_dir)
    prefix = EXISTING_PARTIAL if existing else f".{cut_name(os.path.basename(os.path.abspath(out_dir)))}.partial-"
    parent = out_dir if existing else os.path.dirname(os.path.abspath(out_dir))
    if os.path.isdir(parent):  # (what an export of this name killed there or beside it left goes)
        for entry in os.listdir(parent):
            if entry.startswith(prefix) and os.path.isdir(os.path.join(parent, entry)):
                _remove_abandoned(os.path.join(parent, entry))
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=prefix, dir=parent)
        held = _lock(staging)
    except OSError as e:
        raise UserError(f"cannot create {out_dir}: {why_not_made(out_dir, e)}") from None
    moved = []
    try:
        yield staging
        umask = os.umask(0)
        os.umask(umask)
        # mkdtemp's directory is private, and safetensors writes its file 0600: an export's files are made as any
        # file and directory is, readable by whoever the umask lets read them (a serving container, a colleague)
        for root, dirs, files in os.walk(staging):
            for name in files:
                os.chmod(os.path.join(root, name), 0o666 & ~umask)
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o777 & ~umask)
        os.chmod(staging, 0o777 & ~umask)
        if not existing:
            os.replace(staging, out_dir)
        else:  # each file renamed in (the same file system), config.json last: nothing before is taken for a model
            for name in sorted(os.listdir(staging), key=lambda name: (name == "config.json", name)):
                os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
                moved.append(name)
    except (OSError, SafetensorError) as e:
        for name in moved:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out_dir, name))
        # (free space only where that is what is short: not for a permission or a busy mount)
        full = _errno(e) in (errno.ENOSPC, errno.EDQUOT)
        fix = "free space (or give another directory)" if full else "give another directory"
        raise UserError(f"cannot write {out_dir}: {_why(e)}; {fix}, then run the same command") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(held)


EXISTING_PARTIAL = ".lm-export.partial-"  # an export's staging directory inside an empty out_dir that was there


def check_new_directory(out_dir: str) -> None:
    """Refuse what new_directory would, before anything is read for it (a model's weights, minutes): an empty
    name, a file, a link to no directory, or a directory or prefix with something in it (but what an export killed
    there left, which it removes)."""
    if storage.is_url(out_dir):
        if storage.isfile(out_dir) or storage.names(out_dir):
            raise UserError(f"{out_dir} already exists and is not empty; give a new directory, or remove that one "
                            "first")  # fmt: skip
        storage.check_writable(out_dir, "the directory to export into")  # (a missing bucket: after the export, before)
        return
    if not out_dir:
        raise UserError("the directory to export into is empty ''; give the path of a new directory")
    if os.path.isfile(out_dir):
        raise UserError(f"{out_dir} is a file; give the path of a new directory to export into")
    if os.path.islink(out_dir) and not os.path.exists(out_dir):  # (renaming over it failed: "Not a directory")
        raise UserError(f"{out_dir} is a link to {os.readlink(out_dir)}, which does not exist; make that directory "
                        "(or remove the link), then run the same command")  # fmt: skip
    if os.path.isdir(out_dir) and any(not entry.startswith(EXISTING_PARTIAL) for entry in os.listdir(out_dir)):
        raise UserError(f"{out_dir} already exists and is not empty; give a new directory, or remove that one first")


def _lock(staging: str, wait: bool = True) -> int:
    """A descriptor of an export's staging directory holding flock's exclusive lock on it while the export runs (the
    lock goes with the process, however it ends): what tells a killed export's staging directory from a running
    one's. Raises the OSError of one that cannot be opened, or (without `wait`) is held."""
    fd = os.open(staging, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        raise
    return fd


def _remove_abandoned(staging: str) -> None:
    """Remove an export's staging directory unless an export still runs in it (another export to the same path, or
    to a name that cut_name cuts to the same: removing its staging directory failed it, or let it publish a model
    missing the files written before the removal)."""
    try:
        os.close(_lock(staging, wait=False))
    except OSError:  # held (that export runs), or gone
        return
    shutil.rmtree(staging, ignore_errors=True)


def _uploaded(url: str):
    """new_directory's for a URL (after check_new_directory's refusals, a bucket missing or refusing writes among
    them), written into a local temporary directory, then uploaded; config.json last, so that a failed upload
    leaves no directory a loader takes for a model."""
    staging = tempfile.mkdtemp(prefix="lm-export-")
    try:
        yield staging
        files = sorted(os.listdir(staging), key=lambda name: (name == "config.json", name))
        storage.upload([os.path.join(staging, name) for name in files], [f"{url.rstrip('/')}/{name}" for name in files])
    except (OSError, SafetensorError) as e:
        raise UserError(
            f"cannot write {url}: {_why(e)}; free space on {tempfile.gettempdir()}, then run the same command"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _why(e: BaseException) -> str:
    """What an OSError says, or a SafetensorError of one ("Error while serializing: I/O error: No space left on
    device (os error 28)": its system's words)."""
    if getattr(e, "strerror", None):
        return e.strerror
    found = re.search(r"I/O error: (.+?) \(os error \d+\)", str(e))
    return found.group(1) if found else first_line(e)


def _errno(e: BaseException) -> int | None:
    """The error number of an OSError, or of the one a SafetensorError reports ("(os error 28)")."""
    if getattr(e, "errno", None) is not None:
        return e.errno
    found = re.search(r"\(os error (\d+)\)", str(e))
    return int(found.group(1)) if found else None


def write_weights(tensors: dict[str, np.ndarray], out_dir: str) -> list[str]:
    """Save tensors as model.safetensors, or, above MAX_SHARD_BYTES, as shards named by
    model.safetensors.index.json (as save_pretrained does); return the names written."""
    total = sum(x.nbytes for x in tensors.values())
    if total <= MAX_SHARD_BYTES:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
        return ["model.safetensors"]
    shards, size = [{}], 0
    for name, x in tensors.items():
        if shards[-1] and size + x.nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, name), {"format": "pt"})
    weight_map = {tensor: name for name, shard in zip(names, shards) for tensor in shard}
    write_json(os.path.join(out_dir, INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map})
    return [*names, INDEX]


def release_freed_memory() -> None:
    """Hand the memory freed since the last call back to the system (glibc's malloc_trim; elsewhere nothing).

    Reading a model frees a transient copy of each tensor; glibc keeps such memory in its heaps, which had an
    import's peak at 1.39x the parameter bytes where 1.17x is needed (benchmarks/README.md)."""
    if _libc() is not None:
        _libc().malloc_trim(0)


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim  # glibc only (musl has none)
    except (OSError, AttributeError):
        return None
    return libc
