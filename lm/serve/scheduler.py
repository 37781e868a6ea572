"""Continuous batching: requests' rows take free slots of one decoding batch at step boundaries and leave it when
they stop, so a long request never holds the others back.

    scheduler = Scheduler(params, model_cfg, tokenizer, max_batch=16)
    request = scheduler.submit([Choice(prompt_ids, max_tokens=64, temperature=0.8, top_p=1.0, seed=0)], sink)
    request.cancel()    # e.g. the client went away: its rows leave the batch at the next step

One thread runs the loop, over lm.sampling.slots: drop the rows of cancelled requests; admit waiting rows,
first come first served, into the free slots (each admission prefills its prompt and draws its first token);
run one decoding step for the rows admitted before; then, on the host, turn each row's new token into final
text (lm.sampling.stops.RowText: stop strings, end-of-text, max_tokens) and free the slots of the rows that
stopped. After each step, each request's sink gets its rows' new text, from the loop's thread, in one call; a
row that asks for logprobs gets each token's (lm.sampling.rules.logprobs), computed in the step that drew it; a
row's penalties and logit bias change the logits it draws from (lm.sampling.rules.penalized), not its logprobs.
A row that echoes its prompt and asks for logprobs gets its prompt's tokens' too, on its first event (scored by the
prefill that admits it: Slots.admit's score); one that echoes with max_tokens=0 draws nothing and takes no slot
(Slots.score).
A failure on the device fails the requests in the batch (their sinks get the error) and empties the slots;
the loop goes on with the requests still waiting.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from lm.config import ModelConfig
from lm.errors import first_line
from lm.sampling import rules
from lm.sampling.slots import Slots
from lm.sampling.stops import RowText
from lm.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Choice:
    """One row to generate: checked already (ids in the vocabulary, prompt + max_tokens within the window)."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    stops: tuple[str, ...] = ()
    stop_tokens: tuple[int, ...] = ()  # ids that end the row as end-of-text does (a chat template's end of turn)
    logprobs: int | None = None  # each token's logprob and its this many most likely ids' (<= TOP_LOGPROBS); None: none
    frequency_penalty: float = 0.0  # OpenAI's (lm.sampling.rules.penalized): 0 = off
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias): added to the id's logit
    echo: bool = False  # the prompt's tokens' logprobs too (with logprobs); only an echo may have max_tokens=0


@dataclasses.dataclass(frozen=True)
class Logprob:
    """A drawn token's log-probability under the model, and the most likely ids' (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class Event:
    choice: int  # the row's index in its request
    text: str  # text that became final at this step (may be "")
    tokens: int  # tokens the row has drawn so far
    finish: str | None  # once it stopped: "eot", "stop" or "length" (lm.sampling.stops.Sample.finish)
    logprob: Logprob | None = None  # the token drawn at this step's, where the row asks for logprobs
    prompt: tuple[Logprob, ...] | None = None  # a row's first event, where it echoes with logprobs: the prompt's
    # tokens' after its first


Sink = Callable[[list[Event], str | None], None]  # (the new events, or [] and an error message)
# The error of every request a draining scheduler ends (Scheduler.drain): a server that is stopping.
SHUTTING_DOWN = "the server is shutting down; send the request again once it is back"


class Request:
    def __init__(self, scheduler: Scheduler, choices: Sequence[Choice], sink: Sink):
        self.choices, self.sink = list(choices), sink
        self.cancelled = False
        self._scheduler = scheduler

    def cancel(self) -> None:
        """Stop generating: the request's rows leave the batch (or the queue) at the next step boundary."""
        self.cancelled = True
        self._scheduler._wake()


@dataclasses.dataclass(eq=False)
class _Row:
    request: Request
    index: int
    text: RowText

    @property
    def choice(self) -> Choice:
        return self.request.choices[self.index]


class Scheduler:
    """The batch of `max_batch` slots and its loop (see the module docstring); submit and cancel from any thread."""

    def __init__(
        self,
        params: Any,
        model_cfg: ModelConfig,
        tokenizer: Tokenizer,
        max_batch: int,
        window: int | None = None,
        top_k: int = 0,
    ):
        """`window`: the tokens a row's prompt and new ones may take (default and at most the model's); `top_k`:
        every sampled row's (lm.sampling.slots)."""
        self.tokenizer = tokenizer
        self.slots = Slots(params, model_cfg, rules.Vocab.of(tokenizer), max_batch, window, top_k)
        self.max_batch = max_batch
        self._rows: list[_Row | None] = [None] * max_batch  # by slot; only the loop's thread touches it
        self._waiting: collections.deque[_Row] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._draining = False
        self._on_drain: list[Callable[[], None]] = []
        self.steps = 0  # decoding steps run
        self._thread = threading.Thread(target=self._loop, name="lm-serve-scheduler", daemon=True)
        self._thread.start()

    def submit(self, choices: Sequence[Choice], sink: Sink) -> Request:
        for c in choices:  # lm.serve.api checks requests; this guards the cache against a caller that did not
            if not c.prompt or len(c.prompt) + c.max_tokens > self.slots.window or c.max_tokens < (not c.echo):
                raise ValueError(
                    f"a row of {len(c.prompt)} + {c.max_tokens} tokens in a {self.slots.window}-token window"
                )
        request = Request(self, choices, sink)
        rows = [_Row(request, i, RowText(self.tokenizer, c.stops, c.stop_tokens)) for i, c in enumerate(choices)]
        with self._cond:  # (the rows made before: the decoding loop waits for this lock at every step)
            if self._draining:
                _tell(request, [], SHUTTING_DOWN)
                return request
            self._waiting.extend(rows)
            self._cond.notify()
        return request

    def load(self) -> dict[str, int]:
        """The slots, those in use, the rows waiting for one, and the decoding steps run so far."""
        busy = sum(r is not None for r in self._rows)
        return {"slots": self.max_batch, "busy": busy, "waiting": len(self._waiting), "steps": self.steps}

    def drain(self) -> None:
        """End every request, running or waiting, and every one submitted from now on, with the error
        SHUTTING_DOWN (at the next step boundary): the server stops, and its clients hear why."""
        with self._cond:
            self._draining = True
            self._cond.notify()
            callbacks, self._on_drain = self._on_drain, []
        for callback in callbacks:
            callback()

    def on_drain(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the scheduler drains (from the thread that drains it; at once if it has)."""
        with self._cond:
            if not self._draining:
                self._on_drain.append(callback)
                return
        callback()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._waiting or any(self._rows))
                if self._closed:
                    return
                if self._draining:
                    self._fail({row.request for row in [*self._rows, *self._waiting] if row is not None}, SHUTTING_DOWN)
                    self._waiting.clear()
                    continue
                self._drop_cancelled()
                free = [slot for slot, row in enumerate(self._rows) if row is None]
                admitted = [(slot, self._waiting.popleft()) for slot in free[: len(self._waiting)]]
            try:
                self._iterate(admitted)
            except Exception as e:  # noqa: BLE001 (a device failure must not stop the server)
                traceback.print_exc(file=sys.stderr)
                failed = {row.request for row in self._rows if row is not None} | {row.request for _, row in admitted}
                self._fail(failed, f"generation failed: {type(e).__name__}: {first_line(e)}")

    def _fail(self, requests: set[Request], error: str) -> None:
        """Empty the slots and hand `requests` the error."""
        self._rows = [None] * self.max_batch
        self.slots.reset()
        for request in requests:
            _tell(request, [], error)

    def _drop_cancelled(self) -> None:
        self._rows = [None if row is None or row.request.cancelled else row for row in self._rows]
        if any(row.request.cancelled for row in self._waiting):
            self._waiting = collections.deque(row for row in self._waiting if not row.request.cancelled)

    def _iterate(self, admitted: list[tuple[int, _Row]]) -> None:
        stepping = np.asarray([row is not None for row in self._rows])
        firsts = []
        events: dict[Request, list[Event]] = collections.defaultdict(list)
        prompts: dict[int, tuple[Logprob, ...]] = {}  # by slot: the prompt logprobs of an echo's first event
        for slot, row in admitted:
            c = row.choice
            score = c.echo and c.logprobs is not None
            if not c.max_tokens:  # (its slot stays free)
                scored = _prompt_logprobs(c.prompt, _host(self.slots.score(c.prompt)), c.logprobs) if score else None
                events[row.request].append(Event(row.index, "", 0, "length", prompt=scored))
                continue
            first = self.slots.admit(
                slot, c.prompt, c.seed, c.temperature, c.top_p, c.logprobs is not None, c.frequency_penalty,
                c.presence_penalty, dict(c.logit_bias), score,
            )  # fmt: skip
            if score:  # (scored by the prefill that admitted it)
                prompts[slot] = _prompt_logprobs(c.prompt, _host(self.slots.scored), c.logprobs)
            firsts.append((slot, first, self.slots.logprobs))
            self._rows[slot] = row
        tokens_B = self.slots.step(stepping) if stepping.any() else None
        logprobs = self.slots.logprobs if tokens_B is not None else None
        for slot, first, first_logprobs in firsts:
            self._take(slot, int(first), events, _host(first_logprobs), 0, prompts.get(slot))
        if tokens_B is not None:
            self.steps += 1
            logprobs = _host(logprobs)
            for slot, token in enumerate(np.asarray(tokens_B).tolist()):
                if stepping[slot]:
                    self._take(slot, token, events, logprobs, slot)
        for request, new in events.items():
            if not request.cancelled:
                _tell(request, new, None)

    def _take(
        self,
        slot: int,
        token: int,
        events: dict[Request, list[Event]],
        logprobs: rules.Logprobs | None,
        r: int,
        prompt: tuple[Logprob, ...] | None = None,
    ) -> None:
        """A row's new token (`logprobs`' row `r` its logprobs, if computed; `prompt`, its first event's prompt
        logprobs): its new final text, and its slot freed if it stopped."""
        row = self._rows[slot]
        text = row.text.push(token, last=len(row.text.ids) + 1 == row.choice.max_tokens)
        logprob = None
        if row.choice.logprobs is not None and logprobs is not None:
            logprob = _logprob(logprobs, r, token, row.choice.logprobs)
        events[row.request].append(Event(row.index, text, len(row.text.ids), row.text.finish, logprob, prompt))
        if row.text.finish:
            self._rows[slot] = None


def _logprob(logprobs: rules.Logprobs, r: int, token: int, k: int) -> Logprob:
    """Row `r` of logprobs on the host, for `token`, with its `k` most likely ids'."""
    top = zip(logprobs.ids_BK[r, :k].tolist(), logprobs.top_BK[r, :k].tolist())
    # (-inf: no token, where the vocabulary has fewer ids than asked for)
    return Logprob(token, float(logprobs.chosen_B[r]), tuple((i, p) for i, p in top if p > -np.inf))


def _prompt_logprobs(prompt: list[int], scored: rules.Logprobs, k: int) -> tuple[Logprob, ...]:
    """The Logprobs of the prompt's tokens after its first, from Slots.score's (on the host), with the `k` most
    likely ids' each."""
    return tuple(_logprob(scored, r, token, k) for r, token in enumerate(prompt[1:]))


def _host(logprobs: rules.Logprobs | None) -> rules.Logprobs | None:
    """The logprobs fetched from the device, as NumPy arrays (one transfer), or None."""
    return None if logprobs is None else rules.Logprobs(*jax.device_get(tuple(logprobs)))


def _tell(request: Request, events: list[Event], error: str | None) -> None:
    """Hand a request its events; one whose sink fails (its client's event loop has closed) is cancelled, and
    the batch goes on."""
    try:
        request.sink(events, error)
    except Exception:  # noqa: BLE001
        request.cancelled = True
