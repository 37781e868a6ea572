"""Conversations as token ids: a chat template rendered in a sandbox, special tokens only where the template
puts them, and a loss mask on the assistant's turns.

    ids, mask = encode_chat(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    prompt = encode_chat(tokenizer, messages, add_generation_prompt=True)[0]   # for sample.py --chat

The template is the model's own (tokenizer_config.json's chat_template, kept with an imported tokenizer) or,
for lm's models, DEFAULT_TEMPLATE. It runs in Jinja2's immutable sandbox, as transformers runs it, with
messages, bos_token, eos_token and add_generation_prompt. Each message's content is found again in the
rendered text: text there is encoded as text, so a message containing "<|im_end|>" keeps those characters,
while the special tokens the template writes around it become their ids. The mask is 1 on the tokens of
assistant messages and on the first special token the template puts after each (its end of turn).
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import unicodedata
from collections.abc import Sequence

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lm.errors import UserError
from lm.tokenizer import Tokenizer

# lm's models have one special token, end-of-text, which ends each assistant turn.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
ROLES = ("system", "user", "assistant")


def template_of(tokenizer: Tokenizer) -> str:
    return (tokenizer.hf or {}).get("chat_template") or DEFAULT_TEMPLATE


def encode_chat(
    tokenizer: Tokenizer, messages: Sequence[dict], add_generation_prompt: bool = False
) -> tuple[list[int], np.ndarray]:
    """(ids, loss mask) of a conversation rendered with the tokenizer's chat template."""
    messages = _checked(messages, tokenizer)
    text = render(tokenizer, messages, add_generation_prompt)
    spans = _content_spans(text, messages)
    special = tokenizer.special_tokens
    ids: list[int] = []
    mask: list[int] = []
    after_assistant = False
    at = 0
    for start, end, role in [*spans, (len(text), len(text), None)]:
        # Template text before this message: its special tokens become ids, the rest is encoded as text.
        for piece, token in _split_special(text[at:start], special):
            if token is None:
                new = tokenizer.encode(piece)
                ids += new
                mask += [0] * len(new)
            else:
                ids.append(token)
                mask.append(int(after_assistant))  # the first special token after a reply ends its turn
                after_assistant = False
        if role is not None:
            new = tokenizer.encode(text[start:end])
            ids += new
            mask += [int(role == "assistant")] * len(new)
            after_assistant = role == "assistant"
        at = end
    return ids, np.array(mask, np.uint8)


def turn_end(tokenizer: Tokenizer) -> str:
    """The text of the special token that ends an assistant's turn in the template (a stop for --chat)."""
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    ids, mask = encode_chat(tokenizer, probe)
    names = _names(tokenizer)
    ends = [names[i] for i, m in zip(ids, mask) if m and i in names]
    if not ends:
        raise UserError("the chat template ends an assistant's turn with no special token; lm cannot tell where it stops")
    return ends[0]


def render(tokenizer: Tokenizer, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as the template writes it."""
    names = _names(tokenizer)
    try:
        return _compiled(template_of(tokenizer)).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=names.get(tokenizer.hf["bos"]) if tokenizer.hf and tokenizer.hf.get("bos") is not None else "",
            eos_token=names[tokenizer.eot],
        )
    except jinja2.TemplateError as e:
        raise UserError(f"the chat template failed: {e}") from None


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which some templates put around an assistant's reply for
    transformers' assistant mask: rendered as its body (lm finds the replies itself, in _content_spans)."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.cache
def _compiled(template: str) -> jinja2.Template:
    """The template in the environment transformers renders chat templates in: the same sandbox and whitespace
    settings, loop controls ({% break %}, {% continue %}), the generation tag, a tojson that writes plain JSON
    (Jinja's own escapes <, >, & and ' for HTML) and the globals raise_exception and strftime_now."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"the chat template is not valid Jinja ({e.message}, line {e.lineno})") from None


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _names(tokenizer: Tokenizer) -> dict[int, str]:
    return {i: text for text, i in tokenizer.special_tokens.items()}


def _checked(messages: Sequence[dict], tokenizer: Tokenizer) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UserError("a conversation is a non-empty list of messages, each {\"role\": ..., \"content\": ...}")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise UserError(f"a message must be {{\"role\": one of {', '.join(ROLES)}, \"content\": a string}}, got {m!r:.80}")
        content = m["content"]
        if tokenizer.hf and tokenizer.hf.get("normalize"):
            content = unicodedata.normalize(tokenizer.hf["normalize"], content)
        out.append({"role": m["role"], "content": content})
    return out


def _content_spans(text: str, messages: list[dict]) -> list[tuple[int, int, str]]:
    """(start, end, role) of each message's content in the rendered text, in order."""
    spans, at = [], 0
    for m in messages:
        start = text.find(m["content"], at)
        if start < 0:
            raise UserError(
                f"the chat template does not write a {m['role']} message's content as it is; lm needs each content "
                "verbatim in the rendered conversation to tell text from template"
            )
        spans.append((start, start + len(m["content"]), m["role"]))
        at = start + len(m["content"])
    return spans


def _split_special(text: str, special: dict[str, int]):
    """(text piece, None) and (special token text, id) in order, splitting at the special tokens' texts."""
    pattern = _special_pattern(tuple(sorted(special, key=len, reverse=True)))
    for k, piece in enumerate(pattern.split(text)):
        if k % 2:
            yield piece, special[piece]
        elif piece:
            yield piece, None


@functools.cache
def _special_pattern(texts: tuple[str, ...]) -> re.Pattern:
    return re.compile("(" + "|".join(map(re.escape, texts)) + ")")
