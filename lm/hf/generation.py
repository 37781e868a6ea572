"""generation_config.json's sampling settings: what `sample.py hf:DIR` and `lm.serve hf:DIR` sample with by default.

    settings, notes = sampling_defaults("model_dir/", SampleConfig())   # notes: the settings lm does not apply

A model's authors write the settings they recommend there (Llama 3: do_sample, temperature 0.6, top_p 0.9; Qwen2.5:
temperature 0.7, top_p 0.8, top_k 20). transformers samples only where do_sample is true, and then fills what the
file leaves out with its own defaults (temperature 1, top_k 50, top_p 1); lm reads the file so: do_sample false is
greedy, do_sample true is transformers' settings, and a file that says neither (GPT-2's names only its token ids)
replaces only the settings it names in lm's own. What lm's sampling has no counterpart for (a repetition penalty,
min_p, beams, stop strings, suppressed tokens, ...) is named in the notes, for the commands to print, and otherwise
left out.
"""

from __future__ import annotations

import dataclasses
import json
import os

from lm.chat import turn_end
from lm.config import MAX_TEMPERATURE, SampleConfig
from lm.errors import UserError
from lm.tokenizer import Tokenizer

FILE = "generation_config.json"
TRANSFORMERS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # its defaults where do_sample is true
# Settings lm's sampling has no counterpart for, with the value that turns each off.
UNAPPLIED = {
    "repetition_penalty": 1.0,
    "min_p": None,
    "typical_p": 1.0,
    "no_repeat_ngram_size": 0,
    "num_beams": 1,
    "penalty_alpha": None,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "encoder_repetition_penalty": 1.0,
    # transformers applies these while sampling too: a stop string, a least length, tokens kept out or forced
    "stop_strings": None,
    "min_new_tokens": 0,
    "min_length": 0,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "bad_words_ids": None,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
}


def sampling_defaults(directory: str, base: SampleConfig) -> tuple[SampleConfig, list[str]]:
    """(`base` with the settings `directory`'s generation_config.json gives, the notes on the ones lm does not
    apply); `base` as it is where there is no such file."""
    path = os.path.join(directory, FILE)
    if not os.path.exists(path):
        return base, []
    try:
        with open(path, encoding="utf-8") as f:
            given = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read as JSON ({e}); fix or remove it") from None
    if not isinstance(given, dict):
        raise UserError(f"{path} is not a JSON object; fix or remove it")
    do_sample = given.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise UserError(f"{path}: do_sample must be true or false, got {json.dumps(do_sample)}")
    found = {
        name: _checked(path, name, given.get(name)) for name in ("temperature", "top_k", "top_p", "max_new_tokens")
    }
    found = {name: value for name, value in found.items() if value is not None}
    if "max_new_tokens" not in found and given.get("max_length") is not None:
        # transformers' max_length counts the prompt too: a bound the commands lower to what fits the window, which
        # is transformers' count where it is the context (an export's, Llama 2's and TinyLlama's files)
        found["max_new_tokens"] = _checked(path, "max_length", given["max_length"])
    if do_sample is False:
        found = {"temperature": 0.0, **{k: v for k, v in found.items() if k == "max_new_tokens"}}
    elif do_sample:
        found = {**TRANSFORMERS, **found}
    notes = [
        f"{FILE}'s {name}={json.dumps(given[name])} is not applied: "
        + (
            "give them as sample.py's --stop (the server's stop)"
            if name == "stop_strings"
            else "lm samples with temperature, top_k and top_p only"
        )
        for name, off in UNAPPLIED.items()
        if given.get(name) not in (None, off, [], {})
    ]
    return dataclasses.replace(base, **found), notes


def generation_fields(sample: SampleConfig, context: int) -> dict:
    """The generation_config.json fields that have transformers' generate sample as lm samples with `sample`, and
    that sampling_defaults reads back as `sample`: greedy where its temperature is 0, else do_sample with each
    setting (top_k 0 written too: transformers' default would be 50). max_new_tokens where it fits the model's
    `context`, else max_length, the context, where generate stops (sample.py fits the count to the window; a
    learned-position model in transformers failed on positions past it)."""
    length = {"max_new_tokens": sample.max_new_tokens} if sample.max_new_tokens < context else {"max_length": context}
    if sample.temperature == 0:
        return {"do_sample": False, **length}
    settings = ("temperature", "top_k", "top_p")
    return {"do_sample": True, **{name: getattr(sample, name) for name in settings}, **length}


def stop_tokens(tokenizer: Tokenizer, chat: bool) -> list[int]:
    """generation_config.json's eos_token_id: every stop token of the model, and for weights trained on chats
    (`chat`) the token its chat template ends a reply with, where that is none of them (a base model's template:
    Qwen2.5's `<|im_end|>`, whose stop is `<|endoftext|>`), so that transformers' generate ends a chat reply where
    sample.py --chat ends it. (Other weights keep their stops: an import of their export is the tokenizer again.)"""
    try:
        end = [turn_end(tokenizer)] if chat else []
    except UserError:  # (a template that ends a reply with no special token: no chat stops at one)
        end = []
    return list(dict.fromkeys([*tokenizer.stop_ids, *end]))


def _checked(path: str, name: str, value):
    """`value` if it is a setting lm can sample with (None if absent), else one line on the file."""
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "temperature" and number and 0 <= value <= MAX_TEMPERATURE:
        return float(value)
    if name == "top_p" and number and 0 <= value <= 1:
        return float(value)
    if name in ("top_k", "max_new_tokens", "max_length") and isinstance(value, int) and not isinstance(value, bool):
        if value >= (0 if name == "top_k" else 1):
            return value
    wanted = {
        "temperature": f"a number >= 0 and at most {MAX_TEMPERATURE:.3g}",
        "top_p": "a number in [0, 1]",
        "top_k": "an integer >= 0",
        "max_new_tokens": "an integer >= 1",
        "max_length": "an integer >= 1",
    }[name]
    raise UserError(f"{path}: {name} must be {wanted}, got {json.dumps(value)}; correct the file")
