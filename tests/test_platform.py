"""lm.platform: the per-backend choices, decided in one place, resolved once per run and logged.

That each backend's formulation computes the same model is tests/test_model.py's
test_every_platform_computes_the_same_model; that a CPU decodes with its layout and cache write,
tests/test_sampling.py's."""

from __future__ import annotations

import dataclasses
import os

import jax
import pytest

from lm import config as config_lib
from lm import platform
from lm.steps import rows_per_step, step_flops

TINY = os.path.join(config_lib.CONFIG_DIR, "tiny.yaml")


@pytest.fixture
def fresh(monkeypatch):
    """platform.of without its cache, and again without it afterwards (it reads LM_PLATFORM once a backend)."""
    platform.of.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    platform.of.cache_clear()


def resolved(*overrides):
    cfg = config_lib.load(TINY, list(overrides))
    return config_lib.replace(cfg, model=config_lib.resolve_model(cfg.model, 256, cfg.data.block_size))


def test_steps_per_call_follow_the_backend_and_the_step():
    # The CPU presets' shapes: shakespeare_char (4e9 FLOPs a step) 10, shakespeare_char_large (6e11) 5, and one a
    # call from 1e12, where a step takes seconds; accelerators one a call until a benchmark there says otherwise.
    assert [platform.steps_per_call("cpu", f) for f in (4e9, 1.3e10, 5.8e11, 6e12)] == [10, 5, 5, 1]
    assert platform.steps_per_call("gpu", 4e9) == platform.steps_per_call("tpu", 4e9) == 1
    for preset, want in (("shakespeare_char", 10), ("shakespeare_char_large", 5), ("default", 5)):
        cfg = config_lib.load(preset)
        vocab = 256 if cfg.data.tokenizer == "bytes" else 1024
        cfg = config_lib.replace(cfg, model=config_lib.resolve_model(cfg.model, vocab, cfg.data.block_size))
        assert cfg.train.steps_per_call == 0  # the presets leave it to the platform
        assert platform.steps_per_call("cpu", step_flops(cfg)) == want, preset


def test_a_run_fills_in_only_what_it_left_automatic(fresh):
    auto = resolved("train.steps_per_call=0")
    assert (auto.train.loss_chunk, auto.train.steps_per_call) == (-1, 0)
    backend = platform.current()
    p = platform.for_run(auto, step_flops(auto), rows_per_step(auto))
    assert backend.loss_chunk == (1024 if backend.backend == "gpu" else 128)
    assert p.loss_chunk == min(backend.loss_chunk, auto.data.block_size) == 32  # a sequence is one chunk at most
    assert p.steps_per_call == platform.steps_per_call(backend.backend, step_flops(auto))
    filled = platform.resolve(auto, step_flops(auto), rows_per_step(auto))
    assert (filled.train.loss_chunk, filled.train.steps_per_call) == (p.loss_chunk, p.steps_per_call)
    chosen = resolved("train.loss_chunk=0", "train.steps_per_call=3")
    assert platform.resolve(chosen, step_flops(chosen), rows_per_step(chosen)) is chosen  # the user's settings stand
    chosen_run = platform.for_run(chosen, 1.0, rows_per_step(chosen))
    assert dataclasses.replace(chosen_run, backend=backend.backend).steps_per_call == 3


def test_a_gpus_loss_chunk_keeps_its_logits_within_a_bound(fresh):
    """A GPU's 1024 positions a chunk at the shape measured (GPT-2 small, 32 rows, 50,304 bfloat16 logits: 3.3 GB),
    halved for a batch or vocabulary whose chunk would hold more than LOSS_CHUNK_BYTES, to no less than 128; a
    CPU's 128 whatever the shape; a chunk the user sets stands."""
    gpu, cpu = platform.of("gpu", True), platform.of("cpu")
    chunk = lambda p, rows, vocab, dtype="bfloat16": platform.auto_loss_chunk(p, rows, vocab, dtype)
    assert chunk(gpu, 32, 50304) == 1024
    assert chunk(gpu, 32, 100352) == 512  # 6.6 GB in one chunk of 1024
    assert chunk(gpu, 32, 50304, "float32") == 512  # float32 logits: 4 bytes each
    assert chunk(gpu, 8, 128256) == 1024 and chunk(gpu, 64, 152064) == 128  # the floor: 2.5 GB
    assert chunk(dataclasses.replace(gpu, logits="float32"), 32, 50304) == 512
    assert chunk(cpu, 1, 256) == chunk(cpu, 64, 152064) == 128
    fresh.setattr(platform, "current", lambda: gpu)
    n = jax.device_count()  # 1 or 8: a micro-batch of 32 rows split over them, the vocabulary n times GPT-2's
    cfg = resolved("data.batch_size=64", "train.grad_accum=2", "data.block_size=1024", "model.max_seq_len=1024")
    cfg = config_lib.replace(cfg, model={"vocab_size": 50304 * n, "dtype": "bfloat16"})
    assert platform.for_run(cfg, 1.0, rows_per_step(cfg)).loss_chunk == 1024
    run = lambda c: platform.for_run(c, 1.0, rows_per_step(c))
    assert run(config_lib.replace(cfg, data={"batch_size": 128})).loss_chunk == 512
    pairs = config_lib.replace(cfg, data={"format": "preference"})  # batch_size counts pairs: two rows each
    assert run(pairs).loss_chunk == 512
    assert run(config_lib.replace(cfg, train={"loss_chunk": 64})).loss_chunk == 64
    # The log line says what runs: a chunk no longer than a sequence, and the unchunked head's float32 logits
    short = run(config_lib.replace(cfg, data={"block_size": 32}, model={"max_seq_len": 32}))
    assert short.loss_chunk == 32 and "loss chunk 32," in short.describe() and "loss logits compute" in short.describe()
    unchunked = run(config_lib.replace(cfg, train={"loss_chunk": 0}))
    assert "loss chunk off," in unchunked.describe() and "loss logits float32," in unchunked.describe()


def test_lm_platform_overrides_a_choice_and_warns_of_a_bad_one(fresh, capsys):
    fresh.setenv(  # spaces around items and their '=' as written by hand
        "LM_PLATFORM", "norm=autodiff, matmul = general,decode_copies=off,greedy=sideways,colour=red,attention_block=32"
    )
    cpu = platform.of("cpu")
    assert (cpu.norm, cpu.matmul, cpu.decode_copies, cpu.greedy, cpu.cache_write, cpu.attention_block) == (
        "autodiff", "general", False, "first_max", "after_reads", 32
    )
    err = capsys.readouterr().err
    assert "LM_PLATFORM item 'greedy=sideways' is not one of" in err and "'colour=red'" in err
    assert "LM_PLATFORM=norm=autodiff" in cpu.describe()


def test_lm_platform_is_read_at_each_call(fresh):
    # The Python API's runs in one process (lm.train.train in a loop) each take LM_PLATFORM as it is then: a later
    # setting, or none, is not the first one's kept (which the log line, reading the environment, contradicted).
    fresh.setenv("LM_PLATFORM", "norm=autodiff,qkv=split")
    assert (platform.of("cpu").norm, platform.of("tpu").qkv) == ("autodiff", "split")
    fresh.setenv("LM_PLATFORM", "norm=rowsums")
    assert (platform.of("cpu").norm, platform.of("tpu").qkv) == ("rowsums", "fused")
    fresh.delenv("LM_PLATFORM")
    assert platform.of("tpu").norm == "autodiff" and platform.of("cpu").norm == "rowsums"
    assert "LM_PLATFORM" not in platform.of("cpu").describe()
    assert platform.of("cpu") is platform.of("cpu")  # made once a setting: a Transformer's static attribute


def test_deterministic_gpu_ops_are_read_from_xla_flags(fresh):
    for flags, want in (
        ("", False),
        ("--xla_gpu_deterministic_ops=true", True),
        ("--xla_gpu_deterministic_ops", True),
        ("--xla_backend_optimization_level=0 --xla_gpu_deterministic_ops=1", True),
        ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", False),  # the last one counts
        ("--xla_gpu_deterministic_ops_extra=true", False),
        # XLA requires determinism of cuDNN's attention under either flag (its RequireDeterminism)
        ("--xla_gpu_exclude_nondeterministic_ops=true", True),
        ("--xla_gpu_exclude_nondeterministic_ops=false --xla_gpu_deterministic_ops=false", False),
        ("--xla_gpu_exclude_nondeterministic_ops --xla_gpu_deterministic_ops=false", True),
    ):
        fresh.setenv("XLA_FLAGS", flags)
        platform.of.cache_clear()
        assert platform.deterministic_ops() is want, flags
        gpu = platform.of("gpu", True)
        assert gpu.deterministic_ops is want and ("deterministic ops" in gpu.describe()) is want
        assert platform.attention_kernel(gpu, "dot_product", "bfloat16")[0] == ("xla" if want else "cudnn")
        assert platform.of("cpu").deterministic_ops is False  # a CPU is deterministic anyway


def test_a_run_logs_its_platform(tiny_args, capsys):
    from lm.train import train

    train(config_lib.load(TINY, [*tiny_args, "train.steps=2", "train.eval_every=0"]))
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("platform "))
    backend = platform.current()
    assert line.startswith(f"platform {backend.backend}")
    assert f"norms {backend.norm}" in line and "1 step per call" in line
    assert "loss chunk 32," in line  # the backend's 128 (1024 on a GPU), no longer than the preset's sequences
    assert f"host malloc {platform.malloc_mode}" in line
