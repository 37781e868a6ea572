"""What training asks of the data: prepare_for_training(data_cfg) -> Prepared (tokenizer, sources, batches).

    prepare.py   text inputs -> token shards and meta.json       sources.py  reading those inputs
    examples.py  JSONL examples -> tokens + loss masks; packing  loaders.py  epochs of windows, mixtures, grain
    preference.py  JSONL chosen/rejected pairs -> tokens + loss masks; batches of pairs
    meta.py      what a prepared directory holds (is it current: lm/prepared_dir.py)  __main__.py lm.data prepare
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
from dataclasses import dataclass

import grain
import numpy as np

from lm import storage
from lm.config import DataConfig, SourceConfig
from lm.data import examples, loaders, preference
from lm.data.loaders import Origin
from lm.data.meta import META, get_tokenizer_for, read_meta
from lm.data.prepare import held_out_by, prepare_source
from lm.errors import UserError, host_memory, memory_size, plural
from lm.files import shown
from lm.prepared_dir import PreparedDir, digest_matches
from lm.tokenizer import HF_BPE, HF_GPT2, Tokenizer, get_tokenizer, same_tokens, spelled_once

UNUSED_WARN = 0.01  # the share of a token stream's train tokens in no window above which a run's start warns


@dataclass(frozen=True)
class Source:
    """One prepared directory of the data: its name in the logs, and its weight in a mixture."""

    name: str
    directory: str
    meta: dict
    weight: float = 1.0

    def item(self) -> dict:
        """What identifies its tokens: the prepared files' checksums and each split's token count."""
        tokens = {split: counts["tokens"] for split, counts in self.meta["splits"].items()}
        return {"checksums": self.meta.get("checksums", {}), "tokens": tokens}

    def val_tokens_per_byte(self) -> float:
        """A token stream's validation tokens per UTF-8 byte of their text: converts loss to bits per byte (fine-tune
        examples: lm.train counts those of the batches evaluated)."""
        val = self.meta["splits"]["val"]
        return val["tokens"] / max(val["bytes"], 1)


@dataclass(frozen=True)
class Prepared:
    """The prepared data of a run (a token stream or a mixture of them to pretrain on, fine-tune examples, or
    preference pairs) and the tokenizer they share."""

    sources: tuple[Source, ...]
    tokenizer: Tokenizer

    @contextlib.contextmanager
    def kept(self, progress: bool):
        """Held while a run trains on it: no prepare writes its directories again (PreparedDir.being_read), and each
        is checked to be still the one prepared or found (another process may have prepared it again since)."""
        with contextlib.ExitStack() as stack:
            for source in self.sources:
                stack.enter_context(PreparedDir(source.directory).being_read(progress))
                now = read_meta(source.directory) or {}
                if now.get("fingerprint") != source.meta.get("fingerprint"):
                    raise UserError(
                        f"{source.directory} was prepared again by another process (from changed inputs) while this "
                        "run started; run the same command again"
                    )
            yield

    @property
    def examples(self) -> bool:
        return self.sources[0].meta.get("kind") == "examples"

    @property
    def pairs(self) -> bool:
        return self.sources[0].meta.get("kind") == "preference"

    @property
    def mixture(self) -> bool:
        return len(self.sources) > 1

    def summary(self, progress: Progress, end: int) -> list[str]:
        """What a run trains on, for its start (prepared just now or found): each source's size, and for a stream
        the epochs of it that step `end` reaches (by `progress`; a fine-tune's are not counted ahead, which would
        pack every epoch up to `end` at start-up)."""
        lines = []
        for source in self.sources:
            train, val = source.meta["splits"]["train"], source.meta["splits"]["val"]
            if self.pairs:
                size = f"{train['pairs']:,} train and {val['pairs']:,} val preference pairs"
            elif self.examples:
                size = f"{train['examples']:,} train and {val['examples']:,} val examples"
                size += f", {train['tokens']:,} train tokens"
            else:
                epochs = progress(end)["epoch" if not self.mixture else f"epoch/{source.name}"]
                documents = source.meta.get("documents", 0)
                size = (f"{train['tokens']:,} train and {val['tokens']:,} val tokens, {documents:,} "
                        f"document{'s' * (documents != 1)}; {epochs:.3g} epochs by step {end}")  # fmt: skip
                if self.mixture:
                    size = f"weight {source.weight:g}, {size}"
            lines.append(f"data{f' {source.name}' if self.mixture else ''}: {size} ({shown(source.directory)})")
        return lines

    def unused_warning(self, data_cfg: DataConfig, progress: Progress) -> str | None:
        """A warning where more than UNUSED_WARN of a token stream's train tokens are in no window (windows never
        cross a shard's end, so each shard's last tokens short of a window, and each source's, are never trained
        on), naming how many and how to use them; None where (nearly) all are used, and for fine-tune data."""
        if self.examples or self.pairs:
            return None
        span = data_cfg.block_size + 1
        tokens = np.array([s.meta["splits"]["train"]["tokens"] for s in self.sources], np.int64)
        unused = int((tokens - progress.windows * span).sum())
        if unused <= UNUSED_WARN * tokens.sum():
            return None
        ranges = sum(len(s.meta["splits"]["train"]["ranges"]) for s in self.sources)
        given = {data_cfg.path, *(spec.path for spec in data_cfg.sources)}
        fix = "lower data.block_size"
        if ranges > len(self.sources):  # (several shards in a source: larger ones lose fewer tokens)
            fix += (", or prepare the data again with a larger --shard-mb (python -m lm.data prepare)"
                    if any(s.directory in given for s in self.sources)
                    else f", or raise data.shard_mb (now {data_cfg.shard_mb:g}; the data is prepared again)")
        if self.mixture:
            fix += ", or join small sources into fewer"
        return (f"warning: {unused:,} of {tokens.sum():,} train tokens ({unused / tokens.sum():.1%}) are in no "
                f"training window and are never trained on: windows of data.block_size+1 = {span} tokens are cut "
                f"from each shard of the training split ({plural(ranges, 'shard')}"
                f"{' of all sources' if self.mixture else ''}) and never cross a shard's end; {fix}")  # fmt: skip

    def has_digest(self, name: str, expected: str) -> bool:
        """Whether the prepared file a dataset item names (NAME/file in a mixture) has the digest a checkpoint
        recorded, in either way lm has written one (digest_matches: a checkpoint of an earlier lm holds the other)."""
        source_name, _, file = name.rpartition("/") if self.mixture else ("", "", name)
        found = [s for s in self.sources if s.name == source_name or not self.mixture]
        path = os.path.join(found[0].directory, file) if found else None
        return bool(path) and storage.isfile(path) and digest_matches(path, expected)

    def steps_for_epochs(self, data_cfg: DataConfig, seed: int, origin: Origin = Origin()) -> int:
        """Optimizer steps in data.epochs passes over the training examples (config validation allows data.epochs
        only for examples), the stream counted from `origin` (lm.data.loaders.Origin)."""
        (source,) = self.sources
        if self.pairs:
            return preference.pair_steps(source.meta, data_cfg.batch_size, data_cfg.epochs, origin)
        return examples.example_steps(
            source.directory, source.meta, data_cfg.block_size, data_cfg.batch_size, seed, data_cfg.epochs, origin
        )

    def rows_before(self, data_cfg: DataConfig, seed: int, origin: Origin, index: int) -> int:
        """The stream row that batch `index` of data_cfg's batch size begins at, counted from `origin`: where a
        stream of another batch size goes on (lm.data.loaders.Origin)."""
        if self.examples:
            (source,) = self.sources
            return examples.example_rows_before(
                source.directory, source.meta, data_cfg.block_size, data_cfg.batch_size, seed, origin, index
            )
        return origin.first_row(index, data_cfg.batch_size)

    def train_iterator(
        self, data_cfg: DataConfig, seed: int, rows: np.ndarray, verbose: bool = True, origin: Origin = Origin()
    ) -> grain.DatasetIterator:
        """The checkpointable stream of this process's `rows` of each training batch, from `origin`."""
        d = data_cfg
        if self.pairs:
            (source,) = self.sources
            return preference.pair_iterator(
                source.directory, source.meta, d.block_size, d.batch_size, seed, rows, origin, d.epochs
            )
        if self.examples:
            (source,) = self.sources
            return examples.example_iterator(
                source.directory, source.meta, d.block_size, d.batch_size, seed, rows=rows, verbose=verbose,
                origin=origin,
            )  # fmt: skip
        windows = [self.windows(s, "train", d) for s in self.sources]
        weights = [s.weight for s in self.sources]
        return loaders.train_iterator(windows, weights, d.batch_size, seed, rows=rows, origin=origin)

    def val_batches(
        self, data_cfg: DataConfig, n_batches: int, rows: np.ndarray, verbose: bool = True
    ) -> dict[str, list]:
        """The same n_batches validation batches (this process's rows of them) of each source, by name, at
        every evaluation."""
        d = data_cfg
        self._check_val_memory(d, n_batches)
        if self.pairs or self.examples:
            (source,) = self.sources
            if self.pairs:
                batches = preference.pair_val_batches(
                    source.directory, source.meta, d.block_size, d.batch_size, n_batches, rows
                )
            else:
                batches = examples.example_val_batches(
                    source.directory, source.meta, d.block_size, d.batch_size, n_batches, rows=rows, verbose=verbose
                )
            if verbose and len(batches) < n_batches:
                held = "pairs" if self.pairs else "examples"
                filled = plural(len(batches), "batch", "batches")
                print(f"note: train.eval_batches={n_batches}, but the {source.meta['splits']['val'][held]} validation "
                      f"{held} of {shown(source.directory)} fill {filled} of {d.batch_size}: each "
                      f"evaluation scores {'that one' if len(batches) == 1 else f'those {len(batches)}'}",
                      file=sys.stderr)  # fmt: skip
            return {source.name: batches}
        out = {}
        for s in self.sources:
            windows = self.windows(s, "val", d)
            if verbose and n_batches * d.batch_size > 2 * windows.n_windows:
                # (evenly spaced over the split: more windows than it holds overlap, scoring each token several times;
                # a few more, as configs/default.yaml's 320 of 312, score a few tokens twice)
                apart = windows.n_windows // d.batch_size
                fix = (f"train.eval_batches of at most {apart} keeps them apart" if apart else
                       f"even one batch of {d.batch_size} rows does: more validation text (data.val_fraction, "
                       "data.val_path) or a smaller data.block_size or data.batch_size keeps them apart")
                print(f"note: train.eval_batches={n_batches} x data.batch_size={d.batch_size} asks for "
                      f"{n_batches * d.batch_size} validation windows, but the validation split of "
                      f"{shown(s.directory)} holds {windows.n_windows}: they overlap, scoring the same tokens several "
                      f"times; {fix}", file=sys.stderr)  # fmt: skip
            out[s.name] = loaders.val_batches(windows, d.batch_size, n_batches, rows)
        return out

    def check(self, data_cfg: DataConfig, n_batches: int) -> None:
        """What training's loader and its `n_batches` validation batches refuse, said before the run directory is
        made (found after, they left a run that had failed): validation batches beyond the host's memory, a token
        stream's split that holds no window of data_cfg.block_size + 1 tokens."""
        self._check_val_memory(data_cfg, n_batches)
        if not (self.examples or self.pairs):
            for source in self.sources:
                for split in ("train", "val"):
                    self.windows(source, split, data_cfg)

    def _check_val_memory(self, d: DataConfig, n_batches: int) -> None:
        held = n_batches * d.batch_size * (d.block_size + 1) * 4 * 2 * len(self.sources)  # (a pair's two rows: 2)
        host = host_memory()
        if held > host // 2:  # (held in memory for the whole run, beside everything else)
            raise UserError(
                f"train.eval_batches={n_batches} validation batches of {d.batch_size} x {d.block_size} tokens "
                f"would take {memory_size(held)} of this host's {memory_size(host)} memory; lower train.eval_batches"
            )

    @staticmethod
    def windows(source: Source, split: str, data_cfg: DataConfig) -> loaders.Windows:
        try:
            return loaders.Windows(source.directory, source.meta, split, data_cfg.block_size, data_cfg.document_mask)
        except UserError as e:
            if len(data_cfg.sources) < 2:
                raise
            raise UserError(f"data source {source.name}: {e}") from None

    def progress(self, data_cfg: DataConfig, seed: int) -> Progress:
        return Progress(self, data_cfg, seed)

    def dataset_item(self) -> dict:
        """What a checkpoint stores of its training data: the prepared files' checksums and token counts
        (under each source's name in a mixture)."""
        if not self.mixture:
            return self.sources[0].item()
        items = {s.name: s.item() for s in self.sources}
        return {part: {f"{name}/{k}": v for name, item in items.items() for k, v in item[part].items()}
                for part in ("checksums", "tokens")}  # fmt: skip


class Progress:
    """How far the training stream has gone after some steps: epochs of each source (and tokens of each in a
    mixture), and the epochs that began since the last call. A fine-tune's epochs are its examples' (packed rows,
    each epoch's own) or its preference pairs'."""

    def __init__(self, data: Prepared, data_cfg: DataConfig, seed: int):
        self.data, self.seed = data, seed
        self.names = [s.name if data.mixture else "" for s in data.sources]
        self.batch, self.block_size = data_cfg.batch_size, data_cfg.block_size
        self.origin = Origin()  # (where a resume changed the batch size: set once the run is restored)
        self.end = None  # (pairs: the stream's place where data.epochs end, its last batch's empty pairs after)
        if data.pairs:
            self.windows = np.array([data.sources[0].meta["splits"]["train"]["pairs"]])
            self.end = int(self.windows[0]) * data_cfg.epochs or None
        elif not data.examples:
            self.mix = loaders.Mixture([s.weight for s in data.sources], seed)
            self.windows = np.array([data.windows(s, "train", data_cfg).n_windows for s in data.sources])
        self._packs = None  # (origin, a fine-tune's examples as its stream packs them from there)
        self.epochs_at = None

    def _epochs(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(epochs done, fractional; epochs begun by step's last row, counted from 0; rows given: a token stream's
        windows, None for examples) of each source after `step` steps."""
        if self.data.examples:
            if self._packs is None or self._packs[0] is not self.origin:
                (s,) = self.data.sources
                made = examples.packs(s.directory, s.meta, self.block_size, self.batch, self.seed, self.origin)
                self._packs = (self.origin, made)
            packs = self._packs[1]
            epoch, row = packs.locate(step)
            begun = packs.locate(max(step - 1, self.origin.index))[0]
            return np.array([epoch + row / packs.rows_in(epoch)]), np.array([begun]), None
        first = self.origin.first_row(step, self.batch)
        if self.end is not None:
            first = min(first, self.end)
        rows = np.array([first]) if self.data.pairs else self.mix.rows_of(first, self.origin)
        return rows / self.windows, np.maximum(rows - 1, 0) // self.windows, rows

    def __call__(self, step: int) -> dict:
        """{"epoch": epochs done, fractional} of the one source, or {"epoch/NAME", "tokens/NAME"} of each."""
        done, _, rows = self._epochs(step)
        if not self.data.mixture:
            return {"epoch": float(done[0])}
        out = {}
        for name, epochs, n in zip(self.names, done, rows):
            out[f"epoch/{name}"] = float(epochs)
            out[f"tokens/{name}"] = int(n) * self.block_size
        return out

    def new_epochs(self, step: int) -> list[str]:
        """'epoch E of SOURCE begins at step S' for each epoch that began in the steps since the last call."""
        _, epochs, _ = self._epochs(step)
        begun = [] if self.epochs_at is None else [
            f"epoch {e + 1}{f' of {name}' if name else ''} begins in step {step}"
            for name, before, e in zip(self.names, self.epochs_at, epochs)
            if e > before
        ]
        self.epochs_at = epochs
        return begun


def check_stream_tokenizer(data_cfg: DataConfig, trained_tokenizer: Tokenizer | None) -> None:
    """Refuse text to pretrain on from weights whose tokenizer was imported with them, which no data.tokenizer
    names (a token stream records its tokenizer by name)."""
    if data_cfg.format == "text" and trained_tokenizer is not None and trained_tokenizer.spec in (HF_BPE, HF_GPT2):
        raise UserError(
            f"init_from's tokenizer is the one imported with its model ({trained_tokenizer.spec}), which no "
            "data.tokenizer names, so a "
            "token stream cannot be prepared with it; train on the text as data.format=examples with {\"text\": ...} "
            "rows (the loss covers all of it), which uses the model's own tokenizer"
        )


def prepare_for_training(
    data_cfg: DataConfig,
    seed: int,
    trained_tokenizer: Tokenizer | None = None,
    progress: bool = True,
    publisher: bool = True,
) -> Prepared:
    """The data a run trains on, prepared into data.cache_dir on first use (a data.cache_dir in object storage
    only by the `publisher` process: the others read what it published).

    Fine-tune examples and preference pairs are tokenized with the starting model's tokenizer
    (trained_tokenizer) if there is one, else data.tokenizer; a token stream brings its own tokenizer, which must be
    the starting model's, and the sources of a mixture must all have the same."""
    if data_cfg.format in ("examples", "chat", "preference") and trained_tokenizer is None:
        if data_cfg.tokenizer.startswith("bpe:"):  # (trained on a text corpus as it is prepared: none is, here)
            raise UserError(
                f"data.format={data_cfg.format} is tokenized with init_from's tokenizer, and there is no init_from; "
                f"data.tokenizer={data_cfg.tokenizer} is trained on a text corpus as that is prepared, which this "
                "data is not: fine-tune a run (init_from=runs/NAME), or name a tokenizer that needs no training "
                "(data.tokenizer=bytes, gpt2 or cl100k_base)"
            )
    if data_cfg.format in ("examples", "chat"):
        tok = trained_tokenizer or get_tokenizer(data_cfg.tokenizer)
        directory, meta = examples.prepare_examples_for_config(data_cfg, tok, seed, progress=progress)
        return Prepared((Source("data", directory, meta),), tok)
    if data_cfg.format == "preference":
        tok = trained_tokenizer or get_tokenizer(data_cfg.tokenizer)
        directory, meta = preference.prepare_preference_for_config(data_cfg, tok, seed, progress=progress)
        return Prepared((Source("data", directory, meta),), tok)
    check_stream_tokenizer(data_cfg, trained_tokenizer)  # before any tokenizing
    specs = data_cfg.sources or [SourceConfig(path=data_cfg.path, val_path=data_cfg.val_path, name="data")]
    names = source_names(specs)
    own_bpe = (
        trained_tokenizer is not None and trained_tokenizer.spec.startswith("bpe:")
        and spelled_once(data_cfg.tokenizer) == spelled_once(trained_tokenizer.spec)
    )  # fmt: skip
    if own_bpe:  # text to prepare with init_from's bpe:N: its ranks (a BPE trained anew on this text gave other ids)
        text_cfg = dataclasses.replace(data_cfg, tokenizer=trained_tokenizer.rank_file)
    elif len(specs) > 1 and data_cfg.tokenizer.startswith("bpe:"):
        for spec in specs:
            if not storage.isfile(os.path.join(spec.path, META)):
                raise UserError(
                    f"data.tokenizer={data_cfg.tokenizer} would train a tokenizer for each source, and a mixture's "
                    "sources must share one: prepare one source with it, then set "
                    "data.tokenizer=THAT_DIRECTORY/tokenizer.tiktoken"
                )
    if len(specs) > 1:
        loaders.mixture_quota([spec.weight for spec in specs])  # (a weight too small to draw: before any preparing)
        refuse_ignored_share(data_cfg, specs)
    text_only = not any(spec.path and storage.isfile(os.path.join(spec.path, META)) for spec in specs)
    if trained_tokenizer is not None and not own_bpe and text_only:  # before a BPE is trained, or the text encoded
        chosen = data_cfg.tokenizer  # (a new bpe:N has ids of its own)
        if chosen.startswith("bpe:") or not same_tokens(get_tokenizer(chosen), trained_tokenizer):
            raise UserError(
                f"init_from uses tokenizer {trained_tokenizer.spec} but data.tokenizer is {chosen}; set "
                "data.tokenizer to match (or fine-tune on data.format=examples, tokenized with the model's tokenizer)"
            )
    prepared, tok = [], None
    for spec, name in zip(specs, names):
        own = lambda c: dataclasses.replace(c, field=spec.field) if spec.field else c  # (its own text field)
        prepared_already = bool(spec.path) and storage.isfile(os.path.join(spec.path, META))
        others = [other.val_path for other in specs if other is not spec and other.val_path]
        # (data.field in a mixture: for the sources that hold records)
        shared = {"held_out": others, "field_optional": len(specs) > 1 and not spec.field}
        meta = None
        if own_bpe and not prepared_already:  # prepared with bpe:N before (the text its BPE was trained on): as it is
            directory, meta = prepare_source(
                own(data_cfg), spec.path, spec.val_path, progress, publisher, look=True, **shared
            )
            if meta and not same_tokens(get_tokenizer_for(directory, meta), trained_tokenizer):
                meta = None
        if meta is None:
            how = text_cfg if own_bpe and not prepared_already else data_cfg
            directory, meta = prepare_source(own(how), spec.path, spec.val_path, progress, publisher, **shared)
        source_tok = get_tokenizer_for(directory, meta)
        if own_bpe and same_tokens(source_tok, trained_tokenizer):  # (named as init_from's: bpe:N, not its file)
            source_tok = trained_tokenizer
        if tok is not None and not same_tokens(source_tok, tok):
            other = " trained on other text" if spelled_once(source_tok.spec) == spelled_once(tok.spec) else ""
            raise UserError(
                f"data source {name} is tokenized with {source_tok.spec}, {prepared[0].name} with {tok.spec}{other}; "
                "a mixture's sources must share one tokenizer: prepare them all with the same data.tokenizer"
            )
        tok = tok or source_tok
        prepared.append(Source(name, directory, meta, spec.weight))
    if trained_tokenizer is not None and not same_tokens(trained_tokenizer, tok):
        if spelled_once(trained_tokenizer.spec) == spelled_once(tok.spec):  # a bpe:N prepared from other text
            raise UserError(
                f"init_from's tokenizer and the prepared data's are both {tok.spec}, but trained on different text "
                f"(their ids differ); point data.path at the text itself, which data.tokenizer={tok.spec} then "
                "prepares with init_from's tokenizer"
            )
        raise UserError(
            f"init_from uses tokenizer {trained_tokenizer.spec} but the data is tokenized with {tok.spec}; "
            "set data.tokenizer to match (or fine-tune on data.format=examples, tokenized with the model's tokenizer)"
        )
    return Prepared(tuple(prepared), tok)


def refuse_ignored_share(data_cfg: DataConfig, specs: list[SourceConfig]) -> None:
    """A mixture's data.val_fraction holds out a share of each source prepared here without a val_path; where every
    source has a val_path or is a prepared directory, with its own split, it holds out nothing: one line (it was
    ignored without a word, as data.path's prepared directory refuses it)."""
    share = data_cfg.val_fraction
    if share in (0, DataConfig().val_fraction):  # (0 holds out nothing, as it says: no source's own split changes)
        return
    ready = {i for i, spec in enumerate(specs) if spec.path and storage.isfile(os.path.join(spec.path, META))}
    if not all(i in ready or spec.val_path for i, spec in enumerate(specs)):
        return  # (a source it holds out a share of)
    for i in sorted(ready):
        meta = read_meta(specs[i].path) or {}
        if meta.get("val_fraction") != share:
            raise UserError(
                f"data.val_fraction={share} is given, but every data.sources entry has a val_path or is already "
                f"prepared, with its own validation split (data.sources[{i}].path={specs[i].path}: "
                f"{held_out_by(meta)}), so it "
                f"holds out nothing; drop data.val_fraction, or prepare that source again (python -m lm.data prepare "
                f"TEXT --val-fraction {share} --out DIR)"
            )


def source_names(specs: list[SourceConfig]) -> list[str]:
    """Each source's name in the logs: its own, or its path's last part; repeats numbered (-2, -3, ...)."""
    names = []
    for spec in specs:
        base = spec.name or re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(spec.path.rstrip("/*"))) or "data"
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}-{n}"
        names.append(name)
    return names


def __getattr__(name: str):
    # The command line is imported on first use: importing it here would put lm.data.__main__ in sys.modules
    # before `python -m lm.data` runs it, which runpy warns about.
    if name == "main":
        from lm.data.__main__ import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
