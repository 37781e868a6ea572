"""Conversations as token ids: a chat template rendered in a sandbox, special tokens only where the template
puts them, and a loss mask on the assistant's turns.

    ids, mask = encode_chat(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    prompt = encode_chat(tokenizer, messages, add_generation_prompt=True)[0]   # for sample.py --chat

The template is the model's own (tokenizer_config.json's chat_template, kept with an imported tokenizer) or,
for lm's models and base models without one, DEFAULT_TEMPLATE (after the BOS token where the tokenizer adds one).
It runs in Jinja2's immutable sandbox, as transformers runs it, with messages, bos_token, eos_token and
add_generation_prompt. Each message's content is found again in the
rendered text: text there is encoded as text, so a message containing "<|im_end|>" keeps those characters,
while the special tokens the template writes around it become their ids. The mask is 1 on the tokens of
assistant messages, on the first special token the template puts after each (its end of turn), and on any
template text between the two.
"""

from __future__ import annotations

import bisect
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

from lm.errors import UserError, cut_short
from lm.tokenizer import Tokenizer, without_surrogates

# The version of encode_chat's loss mask, part of the key of data prepared with it: a change re-prepares that data.
# 2: the template text between a reply and its end-of-turn token is learned too.
# 3: lm's default template starts with the model's BOS token where its tokenizer puts one before every text.
# 4: a template that rewrites a content (Qwen3's last reply) no longer has a content found in its own text before
#    it (a reply "end" in "<|im_end|>"), whose special tokens were encoded as text.
# 5: a reply whose generation prompt is not found before it (a conversation that opens with a reply) is not cut from
#    the template text before it, as transformers encodes it.
# 6: a message the template drops is refused where its text is found in the template's own (a system message "a" in
#    "<|im_start|>"), which was encoded as text.
MASK_VERSION = 6

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
    """The model's own template, else DEFAULT_TEMPLATE, after the BOS token where the tokenizer starts every text
    with one (a base Llama or Mistral): a conversation starts as each text it was pretrained on did."""
    own = (tokenizer.hf or {}).get("chat_template")
    return own or ("{{ bos_token }}" if tokenizer.prefix else "") + DEFAULT_TEMPLATE


class TooLong(UserError):
    """A conversation of at least `fewest` tokens, which leaves no room for a token in encode_chat's `window`."""

    def __init__(self, fewest: int, window: int):
        super().__init__(f"the conversation is {fewest:,} tokens or more, which leaves no room for a token it "
                         f"generates in a window of {window}; shorten the conversation")  # fmt: skip
        self.fewest = fewest


def encode_chat(
    tokenizer: Tokenizer, messages: Sequence[dict], add_generation_prompt: bool = False, window: int | None = None
) -> tuple[list[int], np.ndarray]:
    """(ids, loss mask) of a conversation rendered with the tokenizer's chat template.

    The rendered text is cut at the special tokens the template writes (not at those a message's content holds)
    and where each reply's generation prompt ends; each run of text between, template text and contents together,
    is encoded whole, as transformers' apply_chat_template does: a merge across a content's edge ("User: " +
    "the" as " the") gives the token the model was trained on. A reply whose generation prompt is found before it
    starts a run of its own, so that a
    conversation holds its generation prompt's ids before the reply (what sample.py --chat prompts with), and the
    tokens from there to the reply's end are the ones learned, with any template text after it and the end-of-turn
    token that follows.

    `window`: a conversation that cannot leave a token of room in it raises TooLong, from a count of its tokens that
    takes one rendering, before the encoding, which renders the conversation before each reply again."""
    messages = _checked(messages, tokenizer)
    text, spans, order = _rendered(tokenizer, messages, add_generation_prompt)
    specials = _template_specials(tokenizer, text, spans)
    if window is not None and (fewest := _fewest_tokens(tokenizer, text, specials)) >= window:
        raise TooLong(fewest, window)
    special_starts = [s for s, _, _ in specials]
    # Each reply is learned from where its generation prompt ends (the template may write text of the reply's own
    # after it: "Assistant:" then " " + content), and a run is cut there, no token; else from its content's start,
    # uncut (its first token may hold template text before it: " " + "a" as " a", as transformers encodes it). It is
    # learned up to the special token that ends its turn, with any template text between ("\n" before <|im_end|>),
    # which the model has to write before it stops; not where that token comes after the next message's content.
    def turn_end(k: int, b: int) -> int:
        following = spans[k + 1][0] if k + 1 < len(spans) else len(text)
        i = bisect.bisect_left(special_starts, b)  # (the first special token at or after b, if before following)
        return special_starts[i] if i < len(specials) and special_starts[i] <= following else b

    prompts = [_reply_start(tokenizer, messages[: order[k]], text, a) if role == "assistant" else None
               for k, (a, _, role) in enumerate(spans)]  # fmt: skip
    learned = [(a if p is None else p, turn_end(k, b), role) if role == "assistant" else (a, b, role)
               for k, ((a, b, role), p) in enumerate(zip(spans, prompts))]  # fmt: skip
    replies = [(p, p, None) for p in prompts if p is not None]
    kept = _kept(tokenizer, text, specials)
    ids: list[int] = []
    mask: list[int] = []
    # The learned spans follow each other without overlapping (each reply's after the turn before it ends), so the
    # ones a run meets are found by bisection: a scan of all of them for each run was quadratic in the messages.
    firsts, lasts = [a for a, _, _ in learned], [b for _, b, _ in learned]
    ordered = firsts == sorted(firsts) and lasts == sorted(lasts)
    at = 0
    for start, end, token in sorted([*specials, *replies, (len(text), len(text), None)]):
        near = learned[bisect.bisect_left(lasts, at) : bisect.bisect_right(firsts, start)] if ordered else learned
        run = [(max(a, at) - at, min(b, start) - at, role) for a, b, role in near if a <= start and b >= at]
        piece = text[at:start]
        if not kept[at:start].all():  # whitespace a special token beside it takes
            before = np.concatenate([[0], np.cumsum(kept[at:start])])  # kept characters before each offset
            piece = "".join(c for c, keep in zip(piece, kept[at:start]) if keep)
            run = [(int(before[a]), int(before[b]), role) for a, b, role in run]
        new, owned = _encode_run(tokenizer, piece, run)
        ids += new
        mask += owned
        if token is not None:  # the first special token after a reply ends its turn
            ids.append(token)
            mask.append(int(bool(run) and run[-1][2] == "assistant"))
        at = end
    return ids, np.array(mask, np.uint8)


def _fewest_tokens(tokenizer: Tokenizer, text: str, specials: list[tuple[int, int, int]]) -> int:
    """At most as many tokens as encode_chat gives the rendered `text` with the template's `specials`, in time linear
    in its length: a special token is one, and each stretch of other text between them that is not all whitespace
    (which a special token may take) at least one per the longest token's bytes (as the tokenizer normalizes it:
    counted as one token, a message of megabytes was encoded whole, for seconds, before it was refused)."""
    longest = max(1, int(tokenizer.byte_lengths.max()))
    normalize = tokenizer.hf["normalize"] if tokenizer.hf else None
    cuts = [0, *(i for start, end, _ in specials for i in (start, end)), len(text)]
    fewest = len(specials)
    for a, b in zip(cuts[::2], cuts[1::2]):
        core = text[a:b].strip()
        if core:
            core = unicodedata.normalize(normalize, core) if normalize else core
            fewest += -(-len(core.encode("utf-8", "surrogatepass")) // longest)
    return fewest


def _template_specials(tokenizer: Tokenizer, text: str, spans: list) -> list[tuple[int, int, int]]:
    """(start, end, id) of the special tokens the template writes in `text`, in order: those outside the contents
    (`spans`: each message's (start, end, role)); a content's text is ordinary text, whatever it spells."""
    specials, at = [], 0
    for start, end, _ in [*spans, (len(text), len(text), None)]:
        offset = at
        for piece, token in _split_special(text[at:start], tokenizer.special_tokens):
            if token is not None:
                specials.append((offset, offset + len(piece), token))
            offset += len(piece)
        at = end
    return specials


def _kept(tokenizer: Tokenizer, text: str, specials: list[tuple[int, int, int]]) -> np.ndarray:
    """For each character of the rendered text, whether it is encoded: not where a special token the template
    writes takes the whitespace on its left (lstrip) or right (rstrip), as transformers tokenizes such tokens."""
    kept = np.ones(len(text), bool)
    strip = (tokenizer.hf or {}).get("strip") or {}
    if strip:
        names, taken = _names(tokenizer), np.zeros(len(text), bool)
        for start, end, _ in specials:
            taken[start:end] = True
        for start, end, token in specials:
            left, right = strip.get(names[token], (False, False))
            k = start
            while left and k > 0 and not taken[k - 1] and text[k - 1].isspace():
                k -= 1
                kept[k] = False
            k = end
            while right and k < len(text) and not taken[k] and text[k].isspace():
                kept[k] = False
                k += 1
    return kept


def _reply_start(tokenizer: Tokenizer, before: list[dict], text: str, content_start: int) -> int | None:
    """Where the conversation `before` a reply, rendered with its generation prompt, ends in `text`, the whole
    conversation's rendering: what sample.py --chat prompts with, so the tokens after it are the ones a model
    generates. None where that prompt is not a prefix of it (Mistral's template writes the system message in the
    prompt's last user turn, which the whole conversation writes after the reply)."""
    if not before:
        return None
    try:
        prompt = render(tokenizer, before, add_generation_prompt=True)
    except UserError:  # a template that refuses the shorter conversation
        return None
    return len(prompt) if text.startswith(prompt) and len(prompt) <= content_start else None


def _encode_run(tokenizer: Tokenizer, text: str, spans) -> tuple[list[int], list[int]]:
    """The ids of a run of text with no special token, and for each 1 where it holds a byte of an assistant's
    content (`spans`: (start, end, role) in the run)."""
    ids = tokenizer.encode(text)
    form = (tokenizer.hf or {}).get("normalize")
    size = lambda piece: len((unicodedata.normalize(form, piece) if form else piece).encode("utf-8"))
    ends = np.cumsum([len(b) for b in tokenizer.encoding.decode_tokens_bytes(ids)])
    starts = ends - np.diff(ends, prepend=0)
    owned = np.zeros(len(ids), bool)
    for a, b, role in spans:
        if role == "assistant" and b > a:
            owned |= (starts < size(text[:b])) & (ends > size(text[:a]))
    return ids, owned.astype(int).tolist()


def turn_end(tokenizer: Tokenizer, messages: Sequence[dict] = ()) -> int:
    """The special token that ends an assistant's turn in the template: a stop token for --chat and the server's
    chat completions (the token, not its text, which a reply may also spell in ordinary tokens), and what chat data
    teaches a model to stop with (a template without one is refused before it trains). Found by rendering a reply
    after a user's message, else after a system's and a user's (a template may refuse a conversation that does not
    open with a system message, say), else after `messages`, the conversation being prompted (rendered last: a long
    one is encoded once more). A prompt whose template renders none of them stops at the model's end-of-text (and
    its other stop tokens, as any sample)."""
    system, user, reply = ({"role": role, "content": c} for role, c in zip(ROLES, "sxy"))
    probes = [[user, reply], [system, user, reply]]
    probes += [[*messages, reply]] if messages and messages[-1].get("role") != "assistant" else []
    refused = None
    for probe in probes:
        try:
            ids, mask = encode_chat(tokenizer, probe)
            break
        except UserError as e:  # a template that refuses this conversation: the next one
            refused = refused or e
    else:  # a template that renders no reply (one that must end with a user's message): the model's own stops
        if messages:
            return tokenizer.eot
        raise refused
    names = _names(tokenizer)
    # The last one learned: a reply is learned up to the first special token after it, and from where its generation
    # prompt ends, which, in a template with no generation prompt, is before the reply's own header (<|im_start|>).
    ends = [i for i, m in zip(ids, mask) if m and i in names and i not in tokenizer.plain_added_ids]  # (<think>: no)
    if not ends:
        raise UserError(
            "the chat template ends an assistant's turn with no special token, so lm cannot tell where a reply stops "
            "(nor teach a model to stop); use a template that writes one after each reply, such as {{ eos_token }}"
        )
    return ends[-1]


def render(tokenizer: Tokenizer, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as the template writes it, given what transformers' apply_chat_template gives a template:
    the messages, add_generation_prompt, tools and documents (none: lm has neither), and the text of each token
    the model names (bos_token, eos_token, pad_token; left undefined where it names none)."""
    names = _names(tokenizer)
    named = {"bos_token": tokenizer.bos, "eos_token": tokenizer.eot, "pad_token": tokenizer.pad}
    tokens = {key: names.get(i) or tokenizer.decode([i]) for key, i in named.items() if i is not None}
    template = _compiled(template_of(tokenizer))
    try:
        return template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, tools=None, documents=None, **tokens
        )
    except jinja2.TemplateError as e:
        raise UserError(f"the chat template failed: {e}") from None
    except Exception as e:  # (the model's own code: a TypeError in a filter, say)
        raise UserError(f"the chat template failed: {type(e).__name__}: {e}") from None


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
            raise UserError(
                f"a message must be {{\"role\": one of {', '.join(ROLES)}, \"content\": a string}}, got {_json(m, 80)}"
            )
        extra = [k for k, v in m.items() if k not in ("role", "content", "reasoning_content") and v not in (None, [])]
        if extra:  # (the template is given role, content and reasoning_content: any other field would be dropped)
            raise UserError(
                f"a message's field {str(extra[0])!r:.40} is not read by lm, which gives the chat template a message's "
                f"role, content and reasoning_content only; drop it, or write it into the content ({_json(m, 60)})"
            )
        out.append({"role": m["role"], "content": _as_encoded(m["content"], tokenizer)})
        reasoning = m.get("reasoning_content")
        if reasoning is not None:  # (an assistant's reasoning, as Qwen3's template and OpenAI-style servers take it)
            if m["role"] != "assistant" or not isinstance(reasoning, str):
                raise UserError(f"reasoning_content is an assistant message's, and a string; got {_json(m, 80)}")
            if not _writes_reasoning(tokenizer):
                if not reasoning:  # (none to drop: as a message without it)
                    continue
                raise UserError(
                    "the chat template does not write an assistant message's reasoning_content, which would be "
                    f"dropped; write the reasoning into its content instead, as the model's replies hold it "
                    f"({_json(m, 60)})"
                )
            out[-1]["reasoning_content"] = _as_encoded(reasoning, tokenizer)
    return out


def check_record(record: dict, where: str) -> None:
    """Refuse a chat data record's tools or documents (`where`: FILE:LINE), which transformers' apply_chat_template
    gives a template and lm does not: they would be dropped."""
    given = [k for k in ("tools", "documents") if record.get(k) not in (None, [])]
    if given:
        raise UserError(f"{where}: the record's {given[0]!r} is not given to the chat template by lm, which renders "
                        "a conversation's messages alone (it would be dropped); drop it, or write it into the system "
                        "message")  # fmt: skip


def _json(value, width: int) -> str:
    """A message as a chat file or request writes it (JSON), cut to `width` characters for an error line, with "..."
    where it is cut (cut bare, `"reasoning_content": "` read as a field that was empty)."""
    return cut_short(json.dumps(value, ensure_ascii=False, default=repr), width)


def _as_encoded(text: str, tokenizer: Tokenizer) -> str:
    """A message's text as the tokenizer reads it: lone surrogates replaced (the loss mask's byte offsets need text
    UTF-8 can encode), normalized where the tokenizer normalizes (Qwen's NFC)."""
    text = without_surrogates(text)
    if tokenizer.hf and tokenizer.hf.get("normalize"):
        text = unicodedata.normalize(tokenizer.hf["normalize"], text)
    return text


def _writes_reasoning(tokenizer: Tokenizer) -> bool:
    """Whether the chat template writes an assistant message's reasoning_content (Qwen3's does)."""
    template = template_of(tokenizer)
    if template not in _WRITES_REASONING:
        user, reply = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
        mark = "\ue000reasoning\ue001"
        reply = {**reply, "reasoning_content": mark}
        try:
            _WRITES_REASONING[template] = mark in render(tokenizer, [user, reply])
        except UserError:  # (a template that refuses this conversation: asked again of a longer one)
            _WRITES_REASONING[template] = mark in render(tokenizer, [{"role": "system", "content": "s"}, user, reply])
    return _WRITES_REASONING[template]


_WRITES_REASONING: dict[str, bool] = {}


def _rendered(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool):
    """The rendered conversation, (start, end, role) of each message's content in it, in the order of the text, and
    the index of each one's message: a template may write a content after later ones (Mistral's system message,
    in the last user turn).

    Where each content lies is found by rendering the conversation again with a marker for each content (private-use
    characters no content holds): a search for the content itself could stop in template text first (an
    assistant's "a" in the "<|im_start|>" of its header). A template may trim contents (Llama 3's `| trim`): then the
    trimmed content is what it wrote."""
    text = render(tokenizer, messages, add_generation_prompt)
    used = set("".join(m["content"] for m in messages))
    free = (c for c in map(chr, range(0xE000, 0xF900)) if c not in used)
    opening, closing = next(free), next(free)
    marks = [f"{opening}{i}{closing}" for i in range(len(messages))]
    skeleton = render(tokenizer, [{**m, "content": k} for m, k in zip(messages, marks)], add_generation_prompt)
    pieces = re.split(f"({re.escape(opening)}\\d+{re.escape(closing)})", skeleton)
    index = {k: i for i, k in enumerate(marks)}
    order = [index.get(k, -1) for k in pieces[1::2]]
    if sorted(order) == list(range(len(messages))):  # each content written once, in any order
        for trim in (False, True):
            spans, out, start = [], [], 0  # (start: the text's length so far; summed again each message, a
            for k, piece in enumerate(pieces):  # conversation of 100,000 messages took 9 minutes)
                if k % 2:
                    content = messages[order[k // 2]]["content"]
                    content = content.strip() if trim else content
                    spans.append((start, start + len(content), messages[order[k // 2]]["role"]))
                    piece = content
                out.append(piece)
                start += len(piece)
            if "".join(out) == text:
                return text, spans, order
    # A template that rewrites some contents: each found after the template's own text around it, confirmed by
    # rendering. (A search for each content first could stop in template text: a reply "end" in the "<|im_end|>"
    # before it, whose special tokens were then encoded as text and learned.)
    if order == list(range(len(messages))):
        written = _written_spans(tokenizer, text, pieces[::2], messages, add_generation_prompt)
        if written is not None:
            return text, written, order
    unwritten = sorted(set(range(len(messages))) - set(order))
    for k in unwritten:  # one the template drops, whatever it says: lost, even where its text is found in another's
        try:  # (a system message "a" was found in "<|im_start|>", whose special token was then encoded as text)
            dropped = render(tokenizer, [*messages[:k], *messages[k + 1 :]], add_generation_prompt) == text
        except UserError:  # (a template that refuses the conversation without it)
            dropped = False
        if dropped:
            raise _lost(k, messages[k])
    try:  # a template that writes a marker unlike a content: by search
        return text, _content_spans(text, messages), list(range(len(messages)))
    except UserError:
        if not unwritten or len(set(order)) < len(order):
            raise
        raise _lost(unwritten[0], messages[unwritten[0]]) from None


def _lost(k: int, message: dict) -> UserError:
    return UserError(
        f"the chat template does not write message {k + 1} ({message['role']}: {message['content']!r:.40}) of this "
        "conversation, which would be lost (Mistral's writes a system message only before a closing user "
        "message); drop it, or put its text in a message the template writes"
    )


def _written_spans(
    tokenizer: Tokenizer, text: str, around: list[str], messages: list[dict], add_generation_prompt: bool
) -> list[tuple[int, int, str]] | None:
    """(start, end, role) of what the template wrote for each content, where it rewrites some (Qwen3 drops the
    reasoning, up to </think>, of replies before the last question, and writes the last reply's reasoning block
    itself). `around` is the template's text around each content with contents of its own (one more than the
    messages). Each content is the text written as it is where it is (a user's content holding template text stays
    that text), else what lies between the template's text around it, a part of the content (what the template kept
    of it: which text is whose is otherwise ambiguous); text the template writes before a content,
    different from the skeleton's, is a beginning of the skeleton's followed by the content as written. Confirmed by
    rendering the conversation with what was found: the same text, or None."""
    spans, at = [], 0
    for k, message in enumerate(messages):
        content, before = message["content"], around[k]
        if text.startswith(before, at):
            start = at + len(before)
        else:  # the template's text before it depends on it (Qwen3's last reply: its reasoning block)
            start = text.find(content, at) if content else -1
            if start < 0 or not before.startswith(text[at:start]):
                return None
        after = around[k + 1]
        if text.startswith(content, start):
            end = start + len(content)
        elif k + 1 == len(messages):
            end = len(text) - len(after)
        else:
            end = text.find(after, start) if after else -1
        if end < start or text[start:end] not in content:  # (a template drops parts of a content, adds none)
            return None
        spans.append((start, end, message["role"]))
        at = end
    if text[at:] != around[-1]:
        return None
    written = [{**m, "content": text[a:b]} for m, (a, b, _) in zip(messages, spans)]
    return spans if render(tokenizer, written, add_generation_prompt) == text else None


def _content_spans(text: str, messages: list[dict]) -> list[tuple[int, int, str]]:
    """(start, end, role) of each message's content in the rendered text, in order."""
    spans, at = [], 0
    for k, m in enumerate(messages):
        content = m["content"]
        start = text.find(content, at)
        if start < 0 and content.strip():  # a template that trims contents
            content = content.strip()
            start = text.find(content, at)
        if start < 0:
            hint = ""
            if "</think>" in content:
                hint = (" (Qwen3's reasoning: `<think>\\n...\\n</think>\\n\\n` before the reply), or give the "
                        "reasoning as the message's reasoning_content")  # fmt: skip
            raise UserError(
                f"the chat template does not write message {k + 1}'s content ({m['role']}: {content!r:.40}) as it is "
                "(or trimmed), nor between the same text whatever the content; lm needs one or the other to tell text "
                f"from template: write it as the template writes it{hint}"
            )
        spans.append((start, start + len(content), m["role"]))
        at = start + len(content)
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
