"""The OpenAI API's request and response bodies: a completion or chat request checked and turned into the
scheduler's rows, and the JSON of responses, stream chunks and errors.

A request's fields are checked as OpenAI checks them (types, ranges), and fields lm cannot honour are refused
rather than ignored: an unknown field, or best_of, tools and the like set to anything but their "off" value.
Every mistake is an APIError: an HTTP status and OpenAI's error object {"error": {"message", "type", "param",
"code"}}.

Prompts. A completion's prompt is text (encoded like sample.py's --prompt: the tokenizer's BOS if it adds one,
never a special token from the text; "" starts from end-of-text), a list of texts, or token ids (one list or a
list of lists). A chat's messages go through the model's chat template (lm.chat): only the template writes
special tokens, and the reply ends at the template's end of turn. Row r of a request (prompt r // n, its
choice r % n) draws with seed + r, as generate's row r does; without a seed, a random one.

Penalties. frequency_penalty and presence_penalty (each in [-2, 2]) and logit_bias ({"token id": bias in [-100,
100]}, real ids only) change the logits a row draws from, as OpenAI defines them (lm.sampling.rules.penalized: the
counts are of the tokens the row generated, not its prompt's); its logprobs stay the model's.

Logprobs. A chat's logprobs=true (with top_logprobs: 0..20) or a completion's logprobs: N (0..20; OpenAI's 0..5)
give each generated token's log-probability under the model (lm.sampling.rules.logprobs: before temperature and
top-p), the stop token's too, in OpenAI's shapes. A token that is no whole UTF-8 alone (a byte of a character that
byte-level BPE splits) is named by its bytes' text with the others as \\xNN escapes, as OpenAI names it; `bytes`
holds its bytes.

Echo. A completion's echo=true puts each prompt's text before its choice's text and, with logprobs: N, its
tokens' before the generated ones' (the first token's logprob and top_logprobs null, as OpenAI gives them; each
later one's under the model's logits at the position before it: lm.sampling.slots.Slots.score); max_tokens=0,
which only an echo may ask for, generates nothing (finish_reason "length"). A stream's first chunk of a choice
carries its prompt's. Scoring tools (lm-eval's local-completions) read the prompt's logprobs this way.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import secrets
import time
import uuid
from typing import Any

from lm.chat import TooLong, encode_chat, turn_end
from lm.errors import UserError, cut_short
from lm.sampling.rules import TOP_LOGPROBS
from lm.serve.scheduler import Choice, Event, Logprob
from lm.tokenizer import Tokenizer

MAX_N = 128  # choices per request, as OpenAI allows
MAX_ROWS = 4096  # rows per request (prompts x n): a request's rows are made at once, and wait in the queue together
MAX_STOPS = 16
FINISH = {"eot": "stop", "stop": "stop", "length": "length"}  # lm's reasons, as OpenAI names them
# Fields lm takes but cannot honour, with the values that mean "off" (which are accepted).
OFF = {
    "echo": (None, False),  # (a completion's only: OpenAI's chat has none)
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
    "store": (None, False),  # (OpenAI keeps a stored completion for its dashboard: nothing here stores one)
    "metadata": (None, {}),  # (tags of a stored completion)
    "service_tier": (None, "auto", "default"),
}
# A completion asks for logprobs with logprobs: N; top_logprobs is a chat's field.
COMPLETION_OFF = {**{k: v for k, v in OFF.items() if k != "echo"}, "top_logprobs": (None, 0)}
SAMPLING = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
            "logprobs", "frequency_penalty", "presence_penalty", "logit_bias"}  # fmt: skip
# A message's fields beyond role, content and reasoning_content, accepted at the values that ask for nothing (a
# message echoed back from an OpenAI response carries refusal: null, annotations: []); else a 400, not dropped.
MESSAGE_OFF = {
    "name": (None, ""),  # a participant's name: no template here writes it
    "refusal": (None, ""),
    "annotations": (None, []),
    "audio": (None,),
    "tool_calls": (None, []),
    "function_call": (None,),
    "tool_call_id": (None, ""),
}
COMPLETION_FIELDS = SAMPLING | {"prompt", "echo"} | COMPLETION_OFF.keys()
CHAT_FIELDS = SAMPLING | {"messages", "max_completion_tokens", "parallel_tool_calls", "top_logprobs"} | OFF.keys()


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Served:
    """The model a server serves: its name in the API, tokenizer and context window (the model's, or --max-len)."""

    name: str
    tokenizer: Tokenizer
    window: int
    limit: str = "the model's context window"  # what sets the window, for error messages
    temperature: float = 1.0  # a request's when it gives none: OpenAI's, or the model's generation_config.json's
    top_p: float = 1.0


@dataclasses.dataclass(frozen=True)
class Parsed:
    chat: bool
    choices: list[Choice]  # prompt-major: row r is prompt r // n's choice r % n
    prompt_tokens: int  # the prompts' tokens, each prompt counted once
    n: int
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
    except RecursionError:
        raise APIError(400, "the request body nests too deeply to parse; send a flatter JSON object") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_kind(body)}")
    _check_text(body)
    return body


def _check_text(body: dict) -> None:
    """Every string of the body is text: JSON's \\u escapes can name half of a UTF-16 pair alone (\\ud800), which
    is no character; sample.py refuses such text in one line, and a stop string of it could never match."""
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack += [*value.keys(), *value.values()]
        elif isinstance(value, list):
            stack += value
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(
                    400,
                    f"the request holds \\u{ord(value[e.start]):04x} alone, half of a UTF-16 surrogate pair, which "
                    "is no character; send text (its pairs whole)",
                ) from None


def check_model(body: dict, served: Served) -> None:
    model = body.get("model", served.name)
    if not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {_kind(model)}", "model")
    if model != served.name:
        raise APIError(
            404, f"the model `{model}` does not exist; this server serves `{served.name}`", "model", "model_not_found"
        )


def parse_completion(body: dict, served: Served) -> Parsed:
    _check_fields(body, COMPLETION_FIELDS, COMPLETION_OFF)
    check_model(body, served)
    if "prompt" not in body:
        raise APIError(400, "prompt is required: text, a list of texts, or token ids", "prompt")
    prompt = body["prompt"]  # (too many rows are refused before a million prompts are tokenized: 12 s for nothing)
    _rows(len(prompt) if isinstance(prompt, list) and prompt and not _is_int(prompt[0]) else 1, body, "prompt")
    prompts = _prompts(prompt, served.tokenizer)
    echo = _bool(body, "echo", False)
    # (OpenAI's: only an echo, the prompt's logprobs, asks for none; false and 0.0 are no integers, said below)
    if _is_int(body.get("max_tokens")) and body["max_tokens"] == 0 and not echo:
        raise APIError(400, "max_tokens must be >= 1, got 0 (0 generates nothing: only with echo=true, to score the "
                       "prompt)", "max_tokens")  # fmt: skip
    max_tokens = _int(body, "max_tokens", 16, low=0 if echo else 1)
    return _parsed(body, served, prompts, max_tokens, "prompt", chat=False, stop_tokens=(), echo=echo)


def parse_chat(body: dict, served: Served) -> Parsed:
    _check_fields(body, CHAT_FIELDS, OFF)
    check_model(body, served)
    _bool(body, "parallel_tool_calls", True)  # (no tools are called: only its type matters)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, 'messages must be a non-empty list of {"role": ..., "content": ...}', "messages")
    tokenizer = served.tokenizer
    try:
        messages = [_message(m, i) for i, m in enumerate(messages)]
        ids = encode_chat(tokenizer, messages, add_generation_prompt=True, window=served.window)[0]
        end = turn_end(tokenizer, messages)
    except TooLong as e:  # (refused before the encoding's longer work)
        raise APIError(
            400,
            f"the conversation is {e.fewest:,} tokens or more, which leaves no room for a token it generates within "
            f"{served.limit} of {served.window} tokens; shorten the conversation",
            "messages",
            "context_length_exceeded",
        ) from None
    except UserError as e:
        raise APIError(400, str(e), "messages") from None
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, max(1, served.window - len(ids)), low=1)
    _int(body, "max_tokens", 0, low=1)  # (checked when max_completion_tokens overrides it too: not ignored if bad)
    return _parsed(body, served, [ids], max_tokens, "messages", chat=True, stop_tokens=(end,), name=name)


def _parsed(body, served, prompts, max_tokens, prompt_param, chat, stop_tokens, name="max_tokens",
            echo=False) -> Parsed:  # fmt: skip
    what = "conversation" if chat else "prompt"  # (a chat has no prompt to shorten: its messages are)
    for p, ids in enumerate(prompts):
        which = f"the {what}" if len(prompts) == 1 else f"prompt {p + 1} of {len(prompts)}"  # (as sample.py names it)
        if not max_tokens:  # (an echo's prompt alone: it may fill the window)
            if len(ids) > served.window:
                raise APIError(
                    400,
                    f"{which} is {_tokens(len(ids))}, more than {served.limit} of {served.window} tokens; shorten "
                    f"the prompt to at most {_tokens(served.window)}",
                    prompt_param,
                    "context_length_exceeded",
                )
            continue
        over = len(ids) + max_tokens - served.window  # (shortening a prompt alone fits where max_tokens < window)
        if max_tokens >= served.window:
            shorten = f"shorten the {what} and lower {name}, to {served.window:,} tokens together"
        elif chat:  # (its default max_tokens is what the window leaves: 1, for a conversation that fills it)
            shorten = f"shorten the conversation by {_tokens(over)}"
        else:  # ("shorten the prompt" by a token left no room for the default 16, and was refused again)
            shorten = f"shorten the prompt to at most {_tokens(served.window - max_tokens)} (with {name}={max_tokens})"
        if len(ids) >= served.window:  # no room for one token, whatever the request asks
            raise APIError(
                400,
                f"{which} is {_tokens(len(ids))}, which leaves no room for a token it generates within "
                f"{served.limit} of {served.window} tokens; {shorten}",
                prompt_param,
                "context_length_exceeded",
            )
        if over > 0:  # (a max_tokens left out is its default, 16: the message said to lower it, not to what)
            default = " (its default)" if body.get(name) is None else ""
            raise APIError(
                400,
                f"{which} is {_tokens(len(ids))}; with {name}={max_tokens}{default} that makes "
                f"{len(ids) + max_tokens:,}, more than {served.limit} of {served.window} tokens; shorten the {what} "
                f"or lower {name} to at most {served.window - len(ids):,}",
                prompt_param,
                "context_length_exceeded",
            )
    temperature = _number(body, "temperature", served.temperature, 0.0, 2.0)
    top_p = _number(body, "top_p", served.top_p, 0.0, 1.0)
    n = _rows(len(prompts), body, prompt_param)
    stream = _bool(body, "stream", False)
    include_usage = _stream_options(body, stream)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise APIError(400, f"user must be a string, got {_kind(body['user'])}", "user")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbits(32)
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise APIError(400, f"seed must be an integer, got {_kind(seed)}", "seed")
    elif seed < 0:  # (as sample.py --seed: -5 drew as 2**32 - 5 here, which sample.py refused)
        raise APIError(400, f"seed must be >= 0, got {seed}", "seed")
    stops = _stops(body.get("stop"))
    logprobs = _logprobs(body, chat)
    frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    bias = _logit_bias(body.get("logit_bias"), served.tokenizer)
    choices = [
        Choice(ids, max_tokens, temperature, top_p, seed + p * n + i, stops, stop_tokens, logprobs, frequency, presence,
               bias, echo)  # fmt: skip
        for p, ids in enumerate(prompts)
        for i in range(n)
    ]
    return Parsed(chat, choices, sum(map(len, prompts)), n, stream, include_usage)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many most likely tokens a request wants beside each generated token's logprob; None: no logprobs."""
    if not chat:  # (false: off, as OpenAI's clients may send it; true is no count)
        if body.get("logprobs") is None or body["logprobs"] is False:
            return None
        return _int(body, "logprobs", 0, low=0, high=TOP_LOGPROBS)
    top = _int(body, "top_logprobs", 0, low=0, high=TOP_LOGPROBS)
    if not _bool(body, "logprobs", False):
        if top:
            raise APIError(
                400, f"top_logprobs={top} needs logprobs=true; set logprobs to true, or drop top_logprobs",
                "top_logprobs",
            )  # fmt: skip
        return None
    return top


def _logit_bias(bias: Any, tokenizer: Tokenizer) -> tuple[tuple[int, float], ...]:
    """A request's logit_bias as (id, bias) pairs: an object of token ids (JSON's keys are strings) to numbers."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise APIError(400, f'logit_bias must be an object of token ids to biases, as {{"50256": -100}}, got '
                       f"{_kind(bias)}", "logit_bias")  # fmt: skip
    pairs, keys = [], {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias keys must be token ids (non-negative integers), got {json.dumps(key):.40}",
                           "logit_bias")  # fmt: skip
        digits = key.lstrip("0") or "0"
        if len(digits) > len(str(tokenizer.n_vocab)):  # (int() refuses over 4,300 digits, and the line would not end)
            raise APIError(400, f"logit_bias: token id {cut_short(digits, 24)} is not in the tokenizer's range [0, "
                           f"{tokenizer.n_vocab})", "logit_bias")  # fmt: skip
        token = int(digits)
        if why := tokenizer.not_a_token([token]):
            raise APIError(400, f"logit_bias: {why}", "logit_bias")
        if token in keys:  # (JSON's own repeated key is one key: the last; these are two strings of one id)
            raise APIError(400, f"logit_bias names token {token} twice ({json.dumps(keys[token]):.40} and "
                           f"{json.dumps(key):.40}); give each token id once", "logit_bias")  # fmt: skip
        keys[token] = key
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            shown = cut_short(json.dumps(value), 40)
            raise APIError(400, f"logit_bias[{token}] must be a number in [-100, 100], got {shown}", "logit_bias")
        pairs.append((token, float(value)))
    return tuple(pairs)


def _rows(prompts: int, body: dict, prompt_param: str) -> int:
    """The request's n, once its prompts x n rows are checked against MAX_ROWS."""
    n = _int(body, "n", 1, low=1, high=MAX_N)
    if prompts * n > MAX_ROWS:
        raise APIError(
            400,
            f"{prompts} prompts x n={n} make {prompts * n} rows, more than the {MAX_ROWS} this server takes "
            "in one request; send the prompts in several requests",
            prompt_param,
        )
    return n


def _check_fields(body: dict, known: set[str], off: dict[str, tuple]) -> None:
    for field, value in body.items():
        if field not in known:
            raise APIError(400, f"Unrecognized request argument supplied: {field}", field, "unknown_parameter")
        if field in off and not _off(value, off[field]):
            raise APIError(400, f"{field}={cut_short(json.dumps(value), 40)} is not supported by this server; drop it",
                           field)  # fmt: skip


def _off(value: Any, offs: tuple) -> bool:
    """Whether `value` is one of a field's off values `offs`, a boolean only as a boolean (Python's False == 0 let
    logprobs=0, which asks for the drawn tokens' logprobs, and best_of=true through as off)."""
    return any(value == off and isinstance(value, bool) == isinstance(off, bool) for off in offs)


def _message(m: Any, i: int) -> dict:
    if not isinstance(m, dict):
        raise APIError(400, f"messages[{i}] must be an object, got {_kind(m)}", "messages")
    role, content = m.get("role"), m.get("content")
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    if role not in ("system", "user", "assistant"):  # (before its fields: a tool message was told to drop its
        shown = json.dumps(role) if "role" in m else "no role"  # tool_call_id, then refused for its role)
        raise APIError(
            400, f"messages[{i}].role must be system, developer, user or assistant, got {shown:.40}", "messages"
        )
    for field, value in m.items():
        if field in ("role", "content", "reasoning_content"):
            continue
        if field not in MESSAGE_OFF:
            unknown = f"messages[{i}].{field:.40} is not a message field this server knows; drop it"
            raise APIError(400, unknown, "messages")
        if not _off(value, MESSAGE_OFF[field]):
            raise APIError(400, f"messages[{i}].{field} is not supported by this server; drop it", "messages")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise APIError(400, f'messages[{i}].content parts must be {{"type": "text", "text": ...}}', "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(400, f"messages[{i}].content must be a string, got {_kind(content)}", "messages")
    reasoning = m.get("reasoning_content")  # (to the template, which writes it or refuses it, as in chat data)
    return {"role": role, "content": content, **({"reasoning_content": reasoning} if reasoning is not None else {})}


def _prompts(prompt: Any, tokenizer: Tokenizer) -> list[list[int]]:
    """The token ids of each prompt."""
    if isinstance(prompt, str):
        return [tokenizer.encode_context(prompt).tolist()]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [tokenizer.encode_context(p).tolist() for p in prompt]
        if all(_is_int(t) for t in prompt):
            return [_token_ids(prompt, tokenizer)]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return [_token_ids(p, tokenizer) for p in prompt]
    raise APIError(
        400,
        "prompt must be a string, a non-empty list of strings, or token ids (a list of integers or of lists)",
        "prompt",
    )


def _token_ids(ids: list[int], tokenizer: Tokenizer) -> list[int]:
    if why := tokenizer.not_a_token(ids):  # (as generate refuses them)
        raise APIError(400, f"prompt {why}", "prompt")
    return list(ids)


def _stops(stop: Any) -> tuple[str, ...]:
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, f"stop must be a string or a list of strings, got {_kind(stop)}", "stop")
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"stop has {len(stops)} strings; give at most {MAX_STOPS}", "stop")
    if "" in stops:
        raise APIError(400, "stop strings must not be empty; give the text to stop at, or leave it out", "stop")
    return tuple(stops)


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        shape = '{"include_usage": true or false, "include_obfuscation": false}'
        raise APIError(400, f"stream_options must be {shape}", "stream_options")
    if _bool(options, "include_obfuscation", False, "stream_options.include_obfuscation"):  # (its off value: false)
        raise APIError(
            400, "stream_options.include_obfuscation: lm does not pad stream events; set it false or leave it out",
            "stream_options",
        )  # fmt: skip
    return _bool(options, "include_usage", False, "stream_options.include_usage")


def _tokens(n: int) -> str:
    return f"{n:,} token{'' if n == 1 else 's'}"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _kind(x: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(x), f"{type(x).__name__} {json.dumps(x)[:40]}"
    )


def _int(body: dict, field: str, default: int, low: int, high: int | None = None) -> int:
    value = body.get(field)
    if value is None:
        return default
    if not _is_int(value):
        raise APIError(400, f"{field} must be an integer, got {_kind(value)}", field)
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise APIError(400, f"{field} must be {bounds}, got {cut_short(str(value), 40)}", field)
    return value


def _number(body: dict, field: str, default: float, low: float, high: float) -> float:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"{field} must be a number, got {_kind(value)}", field)
    if not low <= value <= high:
        raise APIError(400, f"{field} must be in [{low:g}, {high:g}], got {cut_short(str(value), 40)}", field)
    return float(value)


def _bool(body: dict, field: str, default: bool, name: str = "") -> bool:
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name or field} must be true or false, got {_kind(value)}", name or field)
    return value


# --- responses ------------------------------------------------------------------------------------------


class Reply:
    """One request's response as its events arrive: stream chunks, or the whole body at the end."""

    def __init__(self, parsed: Parsed, served: Served):
        self.parsed, self.model, self.tokenizer = parsed, served.name, served.tokenizer
        self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.texts = [""] * len(parsed.choices)
        self.tokens = [0] * len(parsed.choices)
        self.finish: list[str | None] = [None] * len(parsed.choices)
        self._started: set[int] = set()  # choices whose first chunk was made
        # Each choice's tokens' logprobs in the response's shape (chat: an entry of its content; completion: the
        # token's text, logprob, top_logprobs and text_offset); None where the choice asks for none.
        self.logprobs = [[] if c.logprobs is not None else None for c in parsed.choices]
        self._decoders = [codecs.getincrementaldecoder("utf-8")("replace") for _ in parsed.choices]
        self._chars = [0] * len(parsed.choices)  # characters a completion's decoder gave so far, for text_offset

    @property
    def done(self) -> bool:
        return all(self.finish)

    def usage(self) -> dict:
        completion = sum(self.tokens)
        prompt = self.parsed.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def take(self, events: list[Event]) -> list[dict]:
        """Record the events; the stream chunks they make (text that became final, a choice's end)."""
        chunks = []
        for e in events:
            if e.choice not in self._started:
                self._started.add(e.choice)
                if self.parsed.chat:  # the first chunk of a choice names the role
                    chunks.append(self._chunk(e.choice, {"role": "assistant", "content": ""}, None))
                elif self.parsed.choices[e.choice].echo:
                    chunks += self._echo(e)
            self.texts[e.choice] += e.text
            self.tokens[e.choice] = e.tokens
            logprobs = None
            if e.logprob is not None and self.logprobs[e.choice] is not None:
                self.logprobs[e.choice].append(self._logprob(e.choice, e.logprob))
                logprobs = self._logprobs([self.logprobs[e.choice][-1]])
            if e.text or logprobs:  # (a token whose text is held back still brings its logprob)
                delta = {"content": e.text} if self.parsed.chat else e.text
                chunks.append(self._chunk(e.choice, delta, None, logprobs))
            if e.finish:
                self.finish[e.choice] = FINISH[e.finish]
                chunks.append(self._chunk(e.choice, {} if self.parsed.chat else "", self.finish[e.choice]))
        return chunks

    def _echo(self, e: Event) -> list[dict]:
        """The choice's prompt, its text and (where it asks) its tokens' logprobs, before what it generates: the
        chunk that carries them."""
        choice, prompt = e.choice, self.parsed.choices[e.choice].prompt
        control = self.tokenizer.control_ids
        text = self.tokenizer.decode(t for t in prompt if t not in control)
        entries = []
        if self.logprobs[choice] is not None:
            first, raw = self._token(prompt[0])
            entries.append((first, None, None, self._offset(choice, b"" if prompt[0] in control else bytes(raw))))
            entries += [self._logprob(choice, lp) for lp in e.prompt or ()]
            self.logprobs[choice] += entries
        # The generated text is decoded on its own (lm.sampling.stops.RowText): its offsets count from the prompt's.
        self._chars[choice] = len(text)
        self._decoders[choice].reset()
        self.texts[choice] += text
        if not (text or entries):
            return []
        return [self._chunk(choice, text, None, self._logprobs(entries) if entries else None)]

    def usage_chunk(self) -> dict:
        return {**self._head(chunk=True), "choices": [], "usage": self.usage()}

    def body(self) -> dict:
        logprobs = [None if lp is None else self._logprobs(lp) for lp in self.logprobs]
        if self.parsed.chat:
            choices = [
                {"index": i, "message": {"role": "assistant", "content": t}, "logprobs": lp, "finish_reason": f}
                for i, (t, lp, f) in enumerate(zip(self.texts, logprobs, self.finish))
            ]
        else:
            choices = [
                {"index": i, "text": t, "logprobs": lp, "finish_reason": f}
                for i, (t, lp, f) in enumerate(zip(self.texts, logprobs, self.finish))
            ]
        return {**self._head(chunk=False), "choices": choices, "usage": self.usage()}

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.parsed.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "system_fingerprint": None}

    def _token(self, token: int) -> tuple[str, list[int]]:
        """A token's name and bytes: its text, with \\xNN for each byte that is no whole UTF-8 character alone."""
        raw = self.tokenizer.decode_bytes([token])
        return raw.decode("utf-8", errors="backslashreplace"), list(raw)

    def _logprob(self, choice: int, lp: Logprob) -> Any:
        """One token's logprobs in the response's shape (chat or completion)."""
        token, raw = self._token(lp.token)
        if self.parsed.chat:
            top = [dict(zip(("token", "bytes"), self._token(i)), logprob=p) for i, p in lp.top]
            return {"token": token, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top}
        offset = self._offset(choice, b"" if lp.token in self.tokenizer.control_ids else bytes(raw))
        # OpenAI's top_logprobs of a completion hold the drawn token too: up to logprobs + 1 entries.
        top = {**{self._token(i)[0]: p for i, p in lp.top}, token: lp.logprob}
        return token, lp.logprob, top, offset

    def _offset(self, choice: int, raw: bytes) -> int:
        """Where a completion's token's text begins in its text (decoded as the text is, U+FFFD for invalid bytes):
        at the character its first byte is part of, which may begin in an earlier token; the token's bytes are
        taken (`raw`: b"" for a token of no text, at the end of the text so far)."""
        decoder = self._decoders[choice]
        ahead = codecs.getincrementaldecoder("utf-8")("replace")
        ahead.setstate(decoder.getstate())
        offset = self._chars[choice] + len(ahead.decode(raw[:1], final=True)) - len(raw[:1])
        self._chars[choice] += len(decoder.decode(raw))
        return offset

    def _logprobs(self, entries: list) -> dict:
        """A choice's (or a chunk's) logprobs object, of its tokens' entries (_logprob)."""
        if self.parsed.chat:
            return {"content": entries, "refusal": None}
        tokens, logprobs, tops, offsets = map(list, zip(*entries)) if entries else ([], [], [], [])
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _chunk(self, index: int, delta: Any, finish: str | None, logprobs: dict | None = None) -> dict:
        choice = {
            "index": index,
            "delta" if self.parsed.chat else "text": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        head = self._head(chunk=True)
        return {**head, "choices": [choice], **({"usage": None} if self.parsed.include_usage else {})}
