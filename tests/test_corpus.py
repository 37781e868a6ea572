"""Pretraining data at scale: sharded prepare with a manifest, a killed prepare continued, mixtures of sources
(rows by weight, tokens and validation loss per source, exact resume), document masks, and their mistakes.

The exactly-once property of epochs and the mixture's shares are property tests in test_properties.py.
"""

from __future__ import annotations

import json
import shutil
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_losses, assert_same_params, load_tokens, losses, params

from lm import config as config_lib
from lm.config import BUNDLED_CORPUS, DataConfig, ModelConfig
from lm.data import loaders, prepare_for_training
from lm.data import prepare as prepare_lib
from lm.data.meta import load_meta
from lm.data.prepare import prepare
from lm.errors import ConfigError, UserError
from lm.model import Transformer
from lm.train import train


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Two sources cut from the bundled corpus: a (300 kB, plain) and b (100 kB, gzip-compressed JSONL)."""
    import gzip

    root = tmp_path_factory.mktemp("sources")
    with open(BUNDLED_CORPUS, encoding="utf-8") as f:
        text = f.read()
    (root / "a.txt").write_text(text[:300_000], encoding="utf-8")
    paragraphs = [p for p in text[300_000:400_000].split("\n\n") if p]
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": p}) + "\n" for p in paragraphs)
    return root


def test_a_sources_validation_files_are_left_out_of_every_sources_training(texts, tmp_path):
    """A source that is a directory holding another source's val_path: that file was trained on by the first, so
    the other's val_loss was measured on text the model had seen."""
    sources = [config_lib.SourceConfig(path=str(texts / "a.txt"), val_path=str(texts / "b.jsonl.gz"), name="a"),
               config_lib.SourceConfig(path=str(texts), name="all")]  # fmt: skip
    data = DataConfig(tokenizer="bytes", cache_dir=str(tmp_path), sources=sources)
    mixed = prepare_for_training(data, 0, progress=False)
    every = mixed.sources[1].meta["inputs"]
    assert [os.path.basename(i["path"]) for i in every] == ["a.txt"], every
    # A source that holds none of them is prepared where it is alone (its data of before is not prepared again)
    (tmp_path / "c.txt").write_text("other text " * 3000, encoding="utf-8")
    sources[1] = config_lib.SourceConfig(path=str(tmp_path / "c.txt"), name="c")
    data = DataConfig(tokenizer="bytes", cache_dir=str(tmp_path), sources=sources)
    alone = DataConfig(tokenizer="bytes", cache_dir=str(tmp_path), path=str(tmp_path / "c.txt"))
    alone = prepare_for_training(alone, 0, progress=False)
    assert prepare_for_training(data, 0, progress=False).sources[1].directory == alone.sources[0].directory


def test_each_source_of_a_mixture_reads_its_own_field(texts, tmp_path):
    """(data.field was global to a mixture: sources whose JSONL names its text differently could not be mixed.)"""
    import dataclasses
    import gzip

    with gzip.open(texts / "b.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    code = tmp_path / "code.jsonl"
    code.write_text("".join(json.dumps({"content": r["text"], "text": 5}) + "\n" for r in rows), encoding="utf-8")
    given = config_lib.load("tiny", [f"data.sources=[{{path: {texts / 'b.jsonl.gz'}}}, {{path: {code}, field: content}}]"])
    assert [s.field for s in given.data.sources] == ["", "content"]
    data = dataclasses.replace(given.data, tokenizer="bytes", cache_dir=str(tmp_path))
    b, c = (load_tokens(s.directory, "train") for s in prepare_for_training(data, 0, progress=False).sources)
    assert len(b) and (b == c).all()  # the same texts, under another field
    unnamed = dataclasses.replace(data, sources=[data.sources[0], dataclasses.replace(data.sources[1], field="")])
    with pytest.raises(UserError, match=r"code.jsonl:1: 'text' is 5, not a string \(choose another with --field / "
                                        r"data.field / a data.sources entry's field\)"):  # fmt: skip
        prepare_for_training(unnamed, 0, progress=False)


def test_shards_hold_the_stream_one_file_would(texts, tmp_path):
    """Small shards: the manifest lists them with counts and checksums, the splits are ranges of them, and the
    train then val tokens are the same stream as with one shard."""
    one = prepare([str(texts)], "bytes", str(tmp_path / "one"), progress=False)
    many = prepare([str(texts)], "bytes", str(tmp_path / "many"), shard_mb=0.05, progress=False)
    assert len(one["shards"]) == 1 and len(many["shards"]) > 5
    assert sum(s["tokens"] for s in many["shards"]) == one["splits"]["train"]["tokens"] + one["splits"]["val"]["tokens"]
    assert set(many["checksums"]) == {s["name"] for s in many["shards"]}
    for split in ("train", "val"):
        assert many["splits"][split]["tokens"] == one["splits"][split]["tokens"]
        assert many["splits"][split]["bytes"] == one["splits"][split]["bytes"]
        assert (load_tokens(str(tmp_path / "one"), split) == load_tokens(str(tmp_path / "many"), split)).all()
    # the val tail starts inside a shard: that shard is split between the two ranges
    last_train, first_val = many["splits"]["train"]["ranges"][-1], many["splits"]["val"]["ranges"][0]
    assert last_train[0] == first_val[0] and last_train[2] == first_val[1]
    assert not os.path.exists(tmp_path / "many" / "progress.json")


def test_a_killed_prepare_continues_after_its_last_full_shard(texts, tmp_path, monkeypatch, capsys):
    whole = prepare([str(texts)], "bpe:300", str(tmp_path / "whole"), shard_mb=0.05, progress=False)
    closed, real_close = [], prepare_lib._Shards.close

    def killed_after_three(self, split, position):
        if len(self.state["shards"]) == 3:
            raise KeyboardInterrupt  # as if killed while the fourth shard was being written
        closed.append(position)
        real_close(self, split, position)

    out = str(tmp_path / "out")
    monkeypatch.setattr(prepare_lib._Shards, "close", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(texts)], "bpe:300", out, shard_mb=0.05, progress=False)
    assert sorted(n for n in os.listdir(out) if n.startswith("tokens-")) == [f"tokens-0000{i}.bin" for i in range(3)]
    assert not os.path.exists(os.path.join(out, "meta.json"))
    monkeypatch.setattr(prepare_lib._Shards, "close", real_close)

    encoded = []
    real_tasks = prepare_lib.sources.tasks
    monkeypatch.setattr(
        prepare_lib.sources, "tasks", lambda *a: (encoded.append(a[3]), real_tasks(*a))[1]
    )
    meta = prepare([str(texts)], "bpe:300", out, shard_mb=0.05)
    assert "continuing a prepare that stopped after 3 shards" in capsys.readouterr().err
    assert encoded[0] == tuple(closed[2])  # it read on from the position after the third shard
    for key in ("shards", "splits", "checksums", "documents", "rank_file_sha256", "fingerprint"):
        assert meta[key] == whole[key], key
    assert load_meta(out) == meta


def test_an_interrupt_as_a_full_shard_is_recorded_stays_an_interrupt(texts, tmp_path, monkeypatch):
    """Ctrl-C after a full shard was renamed into place, before it was recorded, was "cannot write prepared data ...:
    No such file or directory; free space" (the shard's temporary file, renamed away, removed again), exit code 2."""
    whole = prepare([str(texts)], "bytes", str(tmp_path / "whole"), shard_mb=0.05, progress=False)
    real_digest = prepare_lib.content_digest

    def interrupted(path, *args):
        if path.endswith("tokens-00002.bin"):
            raise KeyboardInterrupt
        return real_digest(path, *args)

    out = str(tmp_path / "out")
    monkeypatch.setattr(prepare_lib, "content_digest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(texts)], "bytes", out, shard_mb=0.05, progress=False)
    monkeypatch.undo()
    meta = prepare([str(texts)], "bytes", out, shard_mb=0.05, progress=False)
    assert meta["checksums"] == whole["checksums"]


def test_a_changed_input_starts_the_prepare_afresh(texts, tmp_path, monkeypatch):
    src = tmp_path / "src.txt"
    src.write_text((texts / "a.txt").read_text())
    out = str(tmp_path / "out")
    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_lib._Shards, "splits", killed)  # killed after every shard, before meta.json
    with pytest.raises(KeyboardInterrupt):
        prepare([str(src)], "bytes", out, shard_mb=0.05, progress=False)
    monkeypatch.undo()
    src.write_text("something else entirely\n" * 10_000)
    meta = prepare([str(src)], "bytes", out, shard_mb=0.05, progress=False)
    assert bytes(load_tokens(out, "train")[:24].astype(np.uint8)) == b"something else entirely\n"
    assert sorted(n for n in os.listdir(out) if n.startswith("tokens-")) == [s["name"] for s in meta["shards"]]


# ------------------------------------------------------------------------------------------- mixtures

MIX = ["train.steps=12", "train.eval_every=6", "train.ckpt_every=6", "train.log_every=1", "train.eval_batches=2",
       "data.block_size=64", "data.batch_size=8", "data.shard_mb=0.05", "data.document_mask=true"]


def mixture_args(texts, tmp_path, data_cache, run):
    sources = f"data.sources=[{{path: {texts / 'a.txt'}, weight: 3}}, {{path: {texts / 'b.jsonl.gz'}, name: b}}]"
    return [sources, f"run.dir={tmp_path / run}", f"data.cache_dir={data_cache}", "logging.progress=false",
            "train.peak_flops=1e12", "logging.tensorboard=false", *MIX]


def test_a_mixture_logs_each_source_and_resumes_exactly(texts, tmp_path, data_cache, capsys):
    whole = train(config_lib.load("tiny", mixture_args(texts, tmp_path, data_cache, "whole")))
    with open(os.path.join(whole, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    last = [r for r in records if "tokens/a.txt" in r][-1]
    assert last["tokens/a.txt"] + last["tokens/b"] == last["tokens"] == 12 * 8 * 64
    assert last["tokens/a.txt"] / last["tokens"] == pytest.approx(0.75, abs=0.15)
    evals = [r for r in records if "val_loss" in r]
    assert len(evals) == 2
    for r in evals:
        assert r["val_loss"] == pytest.approx(0.75 * r["val_loss/a.txt"] + 0.25 * r["val_loss/b"])
        assert r["val_loss/a.txt"] != r["val_loss/b"]
    out = capsys.readouterr().out
    assert ", a.txt " in out and ", b " in out  # both sources' losses on the evaluation line
    sizes = re.findall(r"^data (a.txt|b): weight ([\d.]+), [\d,]+ train and [\d,]+ val tokens, \d+ documents?; "
                       r"([\d.e-]+) epochs by step 12 \(", out, re.M)  # fmt: skip
    assert [(name, float(w)) for name, w, _ in sizes] == [("a.txt", 3), ("b", 1)], out

    cfg = config_lib.load("tiny", mixture_args(texts, tmp_path, data_cache, "resumed"))
    train(cfg, stop_after=9)
    resumed = train(cfg)
    assert_same_losses(losses(whole), losses(resumed))
    assert_same_params(params(whole, 12), params(resumed, 12))


def test_epochs_begin_on_the_logged_step(tmp_path, data_cache, capsys):
    """The small source's epoch ends within the run: the line names the step whose batch starts epoch 2."""
    text = tmp_path / "small.txt"
    text.write_text("a few words of text. " * 200)  # 4,201 tokens: 64 windows of 65
    run = train(config_lib.load("tiny", [
        f"data.path={text}", "data.val_fraction=0.05", f"run.dir={tmp_path / 'run'}", f"data.cache_dir={data_cache}",
        "logging.progress=false", "train.peak_flops=1e12", "train.steps=20", "data.block_size=64", "data.batch_size=8",
        "train.log_every=1", "train.eval_every=0", "logging.tensorboard=false",
    ]))
    windows = (4201 - int(4201 * 0.05)) // 65
    assert windows == 61
    # rows 0..60 are epoch 1, row 61 is the first of epoch 2: in batch 7, which step 8 trains on
    out = capsys.readouterr().out
    assert "epoch 2 begins in step 8" in out and "epoch 3 begins in step 16" in out
    # The start names the corpus's size and how far the run goes through it (it said nothing of either).
    assert f"data: 3,991 train and 210 val tokens, 1 document; {20 * 8 / 61:.3g} epochs by step 20 (" in out
    with open(os.path.join(run, "metrics.jsonl")) as f:
        epochs = {r["step"]: r["epoch"] for r in map(json.loads, f) if "epoch" in r}
    assert epochs[8] == pytest.approx(64 / 61)
    # An epoch that ends with a step's batch: the next one begins in the step after (it was named a step early, and
    # at the last step an epoch no step began).
    text.write_text("a few words of text. " * 55)  # 1,156 tokens, 1,041 trained: 16 windows of 65, 2 batches of 8
    train(config_lib.load("tiny", [
        f"data.path={text}", "data.val_fraction=0.1", f"run.dir={tmp_path / 'even'}", f"data.cache_dir={data_cache}",
        "logging.progress=false", "train.peak_flops=1e12", "train.steps=6", "data.block_size=64", "data.batch_size=8",
        "train.eval_every=0", "logging.tensorboard=false",
    ]))  # fmt: skip
    even = capsys.readouterr().out
    assert re.findall(r"epoch \d+ begins in step \d+", even) == ["epoch 2 begins in step 3", "epoch 3 begins in step 5"]


def test_document_mask_keeps_attention_within_a_document():
    """Logits for the second document of a window, from its end-of-text token on, equal that document's logits
    alone: nothing crosses into it, and positions restart at the end-of-text. (The end-of-text closed the first
    document: the second's first token was predicted from the whole first document.)"""
    eot = 9
    cfg = ModelConfig(vocab_size=16, max_seq_len=16, n_layer=2, n_head=2, n_embd=32)
    model = Transformer(cfg, True)
    first, second = [1, 2, 3], [eot, 4, 5, 6, 7, 1, 2]
    tokens = np.array([first + second])
    params = model.init(jax.random.PRNGKey(0), jnp.asarray(tokens))
    seg = loaders.document_segments(tokens, eot)
    masked = model.apply(params, jnp.asarray(tokens), jnp.asarray(seg["positions"]), jnp.asarray(seg["segment_ids"]))
    alone = model.apply(params, jnp.asarray([second]))
    np.testing.assert_allclose(masked[0, len(first) :], alone[0], atol=1e-5)
    plain = model.apply(params, jnp.asarray(tokens))
    assert not np.allclose(plain[0, len(first) :], alone[0], atol=1e-3)  # without the mask it does cross


def test_mixture_mistakes(texts, tmp_path, data_cache):
    with pytest.raises(ConfigError, match="set data.path .one source. or data.sources .a mixture., not both"):
        config_lib.load("tiny", [f"data.path={texts / 'a.txt'}", f"data.sources=[{{path: {texts / 'a.txt'}}}]"])
    # (data.val_path beside a mixture was named as data.path, whose move into data.sources would not fix it)
    with pytest.raises(ConfigError, match=r"^data.val_path is data.path's validation data, and a mixture's sources "
                       r"each take their own; move it into its source's entry of data.sources: \{path: FILE, "
                       r"val_path: VAL_FILE\}$"):  # fmt: skip
        config_lib.load("tiny", [f"data.val_path={texts / 'a.txt'}", "data.sources=[{path: a}, {path: b}]"])
    with pytest.raises(ConfigError, match=r"data.sources\[1\].weight must be a finite number > 0, got -1.0"):
        config_lib.load("tiny", ["data.sources=[{path: a}, {path: b, weight: -1}]"])
    with pytest.raises(ConfigError, match=r"data.sources\[0\].weight must be a finite number > 0, got inf"):
        config_lib.load("tiny", ["data.sources=[{path: a, weight: .inf}, {path: b}]"])
    with pytest.raises(ConfigError, match="data.sources' weights add up to more than a number holds"):
        config_lib.load("tiny", ["data.sources=[{path: a, weight: 1e308}, {path: b, weight: 1e308}]"])
    with pytest.raises(ConfigError, match=r"data.sources\[1\] has no path"):  # (it trained on the bundled corpus)
        config_lib.load("tiny", ["data.sources=[{path: a}, {weight: 2}]"])
    with pytest.raises(ConfigError, match="unknown key 'wieght' in a data.sources entry"):
        config_lib.load("tiny", ["data.sources=[{path: a, wieght: 2}]"])
    # ({path:a.txt}: one key of YAML's, "path:a.txt", named as unknown beside path and weight, which it holds)
    with pytest.raises(ConfigError, match=r"^'path:a.txt' in a data.sources entry is read as one key; put a space "
                       r"after the colon: \{path: a.txt\}$"):  # fmt: skip
        config_lib.load("tiny", ["data.sources=[{path:a.txt, weight: 2}]"])
    with pytest.raises(ConfigError, match="data.document_mask is for text"):
        config_lib.load("tiny", ["data.format=examples", "data.document_mask=true"])
    # data.val_fraction=0 with each source's validation data: it was refused for want of data.val_path, which a
    # mixture may not set. (Copies: one source's val_path is never trained on, by any source.)
    shutil.copy(texts / "a.txt", tmp_path / "a_copy.txt")
    shutil.copy(texts / "b.jsonl.gz", tmp_path / "b_copy.jsonl.gz")
    a, b, b_copy = texts / "a.txt", texts / "b.jsonl.gz", tmp_path / "b_copy.jsonl.gz"
    held = f"data.sources=[{{path: {a}, val_path: {b_copy}}}, {{path: {b}"
    with pytest.raises(ConfigError, match=r"data.val_fraction=0 holds out nothing of data.sources\[1\], which has no "
                       "val_path; give it one"):  # fmt: skip
        config_lib.load("tiny", ["data.val_fraction=0", held + "}]"])
    whole = config_lib.load("tiny", ["data.val_fraction=0", f"data.cache_dir={data_cache}",
                                     held + f", val_path: {tmp_path / 'a_copy.txt'}}}]"])  # fmt: skip
    crossed = held.replace(str(b_copy), str(b)) + f", val_path: {a}}}]"  # (each source's val_path the other's text)
    crossed = config_lib.load("tiny", [f"data.cache_dir={data_cache}", crossed])
    with pytest.raises(UserError, match="every training input of .*a.txt is another data source's validation input"):
        prepare_for_training(crossed.data, 0, progress=False)
    a, b = (s.meta["splits"] for s in prepare_for_training(whole.data, 0, progress=False).sources)
    assert a["train"]["tokens"] == b["val"]["tokens"] and b["train"]["tokens"] == a["val"]["tokens"]  # whole files
    prepare([str(texts / "a.txt")], "bytes", str(tmp_path / "bytes"), progress=False)
    prepare([str(texts / "a.txt")], "bpe:300", str(tmp_path / "bpe"), progress=False)
    bpe_file = str(tmp_path / "bpe" / "tokenizer.tiktoken")
    # A source prepared with bpe:N beside text: data.tokenizer=bpe:N, as the line advised, trained one for the text
    # (refused); its rank file is the tokenizer they share, which then trains.
    beside_text = [config_lib.SourceConfig(path=str(tmp_path / "bpe")), config_lib.SourceConfig(path=str(texts))]
    with pytest.raises(UserError, match=f"prepared with tokenizer bpe:300, not data.tokenizer=bytes; set "
                                        f"data.tokenizer={re.escape(bpe_file)} or point data.sources.0..path at"):
        prepare_for_training(DataConfig(tokenizer="bytes", cache_dir=data_cache, sources=beside_text), 0)
    prepare([str(texts / "b.jsonl.gz")], bpe_file, str(tmp_path / "bfile"), progress=False)
    cfg = DataConfig(tokenizer=bpe_file, cache_dir=data_cache, sources=[
        config_lib.SourceConfig(path=str(tmp_path / "bfile")), config_lib.SourceConfig(path=str(texts / "a.txt"), name="a"),
    ])
    assert len(prepare_for_training(cfg, 0, progress=False).sources) == 2  # same rank file: one tokenizer
    # The README's recipe: one source prepared with bpe:N, the others given its tokenizer.tiktoken (the prepared
    # source's own spec says bpe:300, the same ranks).
    recipe = DataConfig(tokenizer=bpe_file, cache_dir=data_cache, sources=[
        config_lib.SourceConfig(path=str(tmp_path / "bpe")), config_lib.SourceConfig(path=str(texts / "b.jsonl.gz")),
    ])  # fmt: skip
    mixed = prepare_for_training(recipe, 0, progress=False)
    assert len(mixed.sources) == 2 and mixed.tokenizer.n_vocab == 300
    bpe_sources = [config_lib.SourceConfig(path=str(texts / "a.txt")), config_lib.SourceConfig(path=str(texts))]
    with pytest.raises(UserError, match="would train a tokenizer for each source, and a mixture's sources must share"):
        prepare_for_training(DataConfig(tokenizer="bpe:300", cache_dir=data_cache, sources=bpe_sources), 0)
    prepare([str(texts / "b.jsonl.gz")], "bpe:300", str(tmp_path / "bpe_b"), progress=False)  # its own BPE
    two_bpes = [config_lib.SourceConfig(path=str(tmp_path / "bpe")), config_lib.SourceConfig(path=str(tmp_path / "bpe_b"))]
    with pytest.raises(UserError, match="data source bpe_b is tokenized with bpe:300, bpe with bpe:300 trained on "
                                        "other text; a mixture's sources must share one tokenizer"):
        prepare_for_training(DataConfig(tokenizer="bpe:300", sources=two_bpes), 0, progress=False)
    with pytest.raises(UserError, match="weight 1e-05 is below 1/16384 of the total"):
        loaders.Mixture([1.0, 0.00001, 1.0], 0)
    tiny_share = [config_lib.SourceConfig(path=str(texts / "a.txt")),
                  config_lib.SourceConfig(path=str(texts), weight=1e5)]  # fmt: skip
    with pytest.raises(UserError, match="weight 1 is below 1/16384 of the total"):  # (refused once all were prepared)
        prepare_for_training(DataConfig(tokenizer="bytes", cache_dir=str(tmp_path / "fresh"), sources=tiny_share), 0)
    assert not (tmp_path / "fresh").exists()


def test_a_format_1_directory_is_read_as_two_shards(tmp_path):
    """Directories prepared before shards (train.bin, val.bin) still train."""
    out = tmp_path / "old"
    out.mkdir()
    np.arange(500, dtype=np.uint16).tofile(out / "train.bin")
    np.arange(100, dtype=np.uint16).tofile(out / "val.bin")
    old = {"format_version": 1, "tokenizer": "bytes", "dtype": "uint16", "eot": 256, "n_vocab": 257,
           "rank_file_sha256": None, "checksums": {},
           "splits": {"train": {"tokens": 500, "bytes": 500, "documents": 0}, "val": {"tokens": 100, "bytes": 100, "documents": 0}}}
    (out / "meta.json").write_text(json.dumps(old))
    data = prepare_for_training(DataConfig(path=str(out), block_size=9, batch_size=2), 0, progress=False)
    batch = next(data.train_iterator(DataConfig(path=str(out), block_size=9, batch_size=2), 0, np.arange(2)))
    assert (batch["inputs"] % 10 == np.arange(9)).all()  # windows of 10 from the start of the shard
    assert len(data.val_batches(DataConfig(block_size=9, batch_size=2), 1, np.arange(2))["data"]) == 1
