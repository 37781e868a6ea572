"""Stop strings: a row's drawn tokens turned into its final text, cut where it stops, and why it finished.

Stopping. A row stops at the end-of-text token or at the first occurrence of a stop string; its
text is cut before the stop string. A special token the model draws that is no text (tokenizer.control_ids: ChatML's
<|im_start|>, a stray <|endoftext|>) is in the row's tokens but not its text, and a stop string that is one's text
(`stop=["<|im_start|>"]`, as OpenAI clients send for ChatML models) stops the row at it. Stop strings are matched
in decoded text on the host: after every step when streaming, every PROGRESS_STEPS steps otherwise (lm.sampling.loop;
a row that met one is then marked done on the device, and draws no more).
A stop string that is a single token also stops its row inside the device loop (lm.sampling.loop).
Streaming holds back text that may still turn into a stop string or complete a multi-byte
character, so the streamed text always equals the non-streamed text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lm.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt: list[int]  # the prompt's ids (the end-of-text token for an empty prompt)
    tokens: list[int]  # every id generated, including a final end-of-text token or the one completing a stop string
    text: str  # the generated text, cut before the first stop string
    finish: str  # "eot" (end-of-text or another stop token), "stop" (a stop string) or "length" (max_new_tokens)


@dataclasses.dataclass(frozen=True)
class Delta:
    token: int | None  # the id the row drew at this step; None once the row has finished
    text: str  # text that became final at this step ("" while a stop string or a character may be incomplete)


def _first_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def _complete(text: str) -> str:
    """A row's text so far without the replacement characters it ends in: maybe the first bytes of a character a
    later token completes, which neither is final nor can match a stop string yet."""
    return text.rstrip("\ufffd")


def _settled(text: str, stops: Sequence[str], start: int = 0) -> int:
    """How much of a row's text so far (its complete characters, _complete) no later token can change or cut: not
    the end of it that begins a stop string. `start`: the text final already, in which no stop string begins (an
    end that begins one there would have been held back before), so only the text after it is looked at: each
    token's cost does not grow with the row's length (16 stop strings of 20,000 characters took 1 ms a token at
    1,000 characters of text, growing with its square, and held back every other row of the batch)."""
    end = len(text)
    for s in stops:
        for k in range(min(len(s) - 1, len(text) - start), 0, -1):
            if text.endswith(s[:k]):
                end = min(end, len(text) - k)
                break
    return end


def _stop_controls(tokenizer: Tokenizer, stops: Sequence[str]) -> set[int]:
    """The special tokens, no text, whose text is one of the stop strings: a row stops at one as at its text."""
    return {tokenizer.special_tokens[s] for s in stops if tokenizer.special_tokens.get(s) in tokenizer.control_ids}


class RowText:
    """One row's output as its tokens arrive: the final text so far, and why the row finished.

    Each token is decoded once: the row's bytes are decoded from the last point where they ended a character
    (`_base`, the text of the first `_cut` bytes), and stop strings are looked for after the final text, which
    ends in no stop string's beginning; decoding every id again at every token made a row's step cost grow with
    its length (2 ms a row at 8,000 tokens, on the host, between the device's steps)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], stop_tokens: Sequence[int] = ()):
        self.tokenizer, self.stops = tokenizer, stops
        self.ends = {*tokenizer.stop_ids, *stop_tokens}  # the tokens that end the row as end-of-text does
        self.control = tokenizer.control_ids  # (drawn, and no text)
        self.stop_controls = _stop_controls(tokenizer, stops)
        self.ids: list[int] = []
        self.text = ""
        self.finish: str | None = None
        self._bytes = bytearray()  # the bytes of the ids drawn, but an ending token's
        self._base, self._cut = "", 0

    def _decoded(self) -> str:
        """The text of every byte so far (tokenizer.decode's: a cut character as U+FFFD)."""
        tail = self._bytes[self._cut :].decode("utf-8", errors="replace")
        text = self._base + tail
        if tail and not tail.endswith("\ufffd"):  # (the bytes end a character: what follows decodes alone)
            self._base, self._cut = text, len(self._bytes)
        return text

    def push(self, token: int, last: bool) -> str:
        """Take the next token (`last`: the final one max_new_tokens allows); return the new final text."""
        self.ids.append(token)
        start = len(self.text)  # (no stop string begins in the final text: _settled held its beginning back)
        if token in self.ends or token in self.stop_controls:
            text = self._decoded()
            cut = _first_stop(text, self.stops, start)  # (in what the characters before it, complete now, spell)
            self.finish = "eot" if cut is None and token in self.ends else "stop"
            return self._extend(text[:cut])
        if token not in self.control:
            self._bytes += self.tokenizer.decode_bytes([token])
        text = self._decoded()
        text = text if last else _complete(text)  # (the last token's text is final however it ends)
        cut = _first_stop(text, self.stops, start)
        if cut is not None:
            self.finish = "stop"
            return self._extend(text[:cut])
        if last:
            self.finish = "length"
            return self._extend(text)
        return self._extend(text[: _settled(text, self.stops, start)])

    def _extend(self, text: str) -> str:
        delta, self.text = text[len(self.text) :], text
        return delta


def row_sample(
    tokenizer: Tokenizer, prompt: list[int], ids: list[int], stops: Sequence[str], n: int, stop_tokens: Sequence[int]
) -> Sample:
    """A finished row's Sample, from the ids the device loop drew for it (n: max_new_tokens)."""
    ended = bool(ids) and (ids[-1] in tokenizer.stop_ids or ids[-1] in stop_tokens)
    text = tokenizer.decode([i for i in (ids[:-1] if ended else ids) if i not in tokenizer.control_ids])
    if _first_stop(text, stops) is None and not _stop_controls(tokenizer, stops).intersection(ids):  # the common case
        return Sample(prompt, ids, text, "eot" if ended else "length")
    row = RowText(tokenizer, stops, stop_tokens)
    for i, token in enumerate(ids):
        row.push(token, last=i == n - 1)
        if row.finish:
            break
    return Sample(prompt, row.ids, row.text, row.finish)
