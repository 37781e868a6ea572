"""What training asks of the data: prepare_for_training(data_cfg) -> Prepared (tokenizer, meta, batches).

    prepare.py   text inputs -> train.bin, val.bin, meta.json        sources.py  reading those inputs
    examples.py  JSONL examples -> tokens + loss masks; packing     loaders.py  windows, one grain iterator
    meta.py      what a prepared directory holds, is it up to date  __main__.py python -m lm.data prepare
"""

from __future__ import annotations

from dataclasses import dataclass

import grain
import numpy as np

from lm.config import DataConfig
from lm.data import examples, loaders
from lm.data.meta import get_tokenizer_for
from lm.data.prepare import prepare_for_config
from lm.errors import UserError
from lm.tokenizer import Tokenizer, get_tokenizer, tokenizer_item


@dataclass(frozen=True)
class Prepared:
    """A prepared directory (a token stream to pretrain on, or fine-tune examples) and its tokenizer."""

    directory: str
    meta: dict
    tokenizer: Tokenizer

    @property
    def examples(self) -> bool:
        return self.meta.get("kind") == "examples"

    def steps_for_epochs(self, data_cfg: DataConfig, seed: int) -> int:
        """Optimizer steps in data.epochs passes over the training examples (config validation allows data.epochs
        only for examples)."""
        return examples.example_steps(
            self.directory, self.meta, data_cfg.block_size, data_cfg.batch_size, seed, data_cfg.epochs
        )

    def train_iterator(self, data_cfg: DataConfig, seed: int, rows: np.ndarray, verbose: bool = True) -> grain.DatasetIterator:
        """The checkpointable stream of this process's `rows` of each training batch."""
        d = data_cfg
        if self.examples:
            return examples.example_iterator(
                self.directory, self.meta, d.block_size, d.batch_size, seed, rows=rows, verbose=verbose
            )
        return loaders.train_iterator(self.directory, self.meta, d.block_size, d.batch_size, seed, rows=rows)

    def val_batches(self, data_cfg: DataConfig, n_batches: int, rows: np.ndarray, verbose: bool = True) -> list[dict]:
        """The same n_batches validation batches (this process's rows of them) at every evaluation."""
        d = data_cfg
        if self.examples:
            return examples.example_val_batches(
                self.directory, self.meta, d.block_size, d.batch_size, n_batches, rows=rows, verbose=verbose
            )
        return loaders.val_batches(self.directory, self.meta, d.block_size, d.batch_size, n_batches, rows=rows)

    @property
    def val_tokens_per_byte(self) -> float:
        """Validation tokens (those with loss) per UTF-8 byte of their text: converts loss to bits per byte."""
        val = self.meta["splits"]["val"]
        with_loss = "loss_tokens" in val
        tokens, n_bytes = (val["loss_tokens"], val["loss_bytes"]) if with_loss else (val["tokens"], val["bytes"])
        return tokens / max(n_bytes, 1)


def prepare_for_training(
    data_cfg: DataConfig, seed: int, trained_tokenizer: Tokenizer | None = None, progress: bool = True
) -> Prepared:
    """The data a run trains on, prepared into data.cache_dir on first use.

    Fine-tune examples are tokenized with the starting model's tokenizer (trained_tokenizer) if there is one,
    else data.tokenizer; a token stream brings its own tokenizer, which must be the starting model's."""
    if data_cfg.format in ("examples", "chat"):
        tok = trained_tokenizer or get_tokenizer(data_cfg.tokenizer)
        directory, meta = examples.prepare_examples_for_config(data_cfg, tok, seed, progress=progress)
        return Prepared(directory, meta, tok)
    directory, meta = prepare_for_config(data_cfg, progress=progress)
    tok = get_tokenizer_for(directory, meta)
    if trained_tokenizer is not None and tokenizer_item(trained_tokenizer) != tokenizer_item(tok):
        raise UserError(
            f"init_from uses tokenizer {trained_tokenizer.spec} but the data is tokenized with {tok.spec}; "
            "set data.tokenizer to match (or fine-tune on data.format=examples, tokenized with the model's tokenizer)"
        )
    return Prepared(directory, meta, tok)


def __getattr__(name: str):
    # The command line is imported on first use: importing it here would put lm.data.__main__ in sys.modules
    # before `python -m lm.data` runs it, which runpy warns about.
    if name == "main":
        from lm.data.__main__ import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
