"""Chat templates: a model's own Jinja template rendered as transformers renders it, and the
rendered prompt cut where the template (never a message) wrote a special token.

- Rendering follows `transformers.utils.chat_template_utils` (not imported).
- What a user typed stays text (`render_chat`): the template is rendered twice, with the
  messages and with each message's text replaced by a placeholder. The first must be the
  second with each placeholder filled (by the text, or the text stripped, as `| trim` writes
  it); special tokens are looked for only in the template's own text, so `<|im_start|>` typed
  in a message never becomes one. A template that rewrites text any other way is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, str]
Conversation = Sequence[Message]

# A placeholder is U+E000, the field's number, U+E001 (private-use characters: no template
# writes them, no filter but a case change alters them).
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


def is_conversation(prompt: object) -> bool:
    """Whether `prompt` is a conversation (a sequence of messages), not a text."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes))


def as_conversations(prompts: Sequence[object]) -> list:
    """Each text prompt as one user's message (conversations are kept): `chat=true`."""
    return [p if is_conversation(p) else [{"role": "user", "content": p}] for p in prompts]


def check_conversation(messages: object, where: str = "the conversation") -> list[dict[str, str]]:
    """`messages` as a list of plain dicts; a ValueError naming the first bad message."""
    if not is_conversation(messages) or not messages:
        raise ValueError(f"{where} must be a non-empty list of {{role, content}} messages, got "
                         f"{messages!r:.80}")
    checked = []
    for index, message in enumerate(messages):
        if (not isinstance(message, Mapping) or not {"role", "content"} <= message.keys()
                or not all(isinstance(k, str) and isinstance(v, str)
                           for k, v in message.items())):
            raise ValueError(f"{where}: message {index} must be a mapping of strings with "
                             f"'role' and 'content', got {message!r:.80}")
        checked.append(dict(message))
    return checked


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """The template compiled in transformers' environment; a ValueError when it does not parse."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e.message} (line {e.lineno} of "
                         f"the template)") from e


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def render(template: str, messages: Conversation, *, add_generation_prompt: bool = True,
           **variables: Any) -> str:
    """The template rendered for `messages` (transformers' `apply_chat_template(...,
    tokenize=False)`); a ValueError carrying the template's own complaint."""
    compiled = compile_template(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **variables)
    except jinja2.TemplateError as e:  # raise_exception(...) in the template, or a misuse
        raise ValueError(f"the chat template refused the conversation: {e}") from e


def render_chat(template: str, messages: Conversation, specials: Iterable[str], *,
                add_generation_prompt: bool = True,
                **variables: Any) -> list[tuple[str, bool]]:
    """The rendered conversation as pieces (text, is_special): special only where the
    template's own text wrote one of `specials`; joined, the pieces are `render(...)`."""
    messages = check_conversation(messages)
    rendered = render(template, messages, add_generation_prompt=add_generation_prompt,
                      **variables)
    fields: list[str] = []  # the text of each placeholder

    def placeholder(key: str, value: str) -> str:
        if key == "role" or not value:  # the template compares roles; "" hides nothing
            return value
        fields.append(value)
        return f"{_OPEN}{len(fields) - 1}{_CLOSE}"

    masked = [{key: placeholder(key, value) for key, value in m.items()} for m in messages]
    skeleton = render(template, masked, add_generation_prompt=add_generation_prompt,
                      **variables)
    parts = _PLACEHOLDER.split(skeleton)  # template text, field number, template text, ...
    template_text, slots = parts[0::2], [int(n) for n in parts[1::2]]
    filled = _fill(rendered, template_text, [fields[n] for n in slots])
    if filled is None:
        raise ValueError("the chat template rewrites message text in a way mtp cannot follow "
                         "(only as it is, or trimmed): mtp cannot tell the template's special "
                         "tokens from typed text")
    pattern = _alternation(specials)
    pieces: list[tuple[str, bool]] = []
    for index, text in enumerate(template_text):
        start = 0
        for match in pattern.finditer(text) if pattern else ():
            pieces += [(text[start:match.start()], False), (match.group(), True)]
            start = match.end()
        pieces.append((text[start:], False))
        if index < len(filled):
            pieces.append((filled[index], False))
    for role in {m["role"] for m in messages}:
        if pattern and pattern.search(role):
            raise ValueError(f"role {role!r} spells a special token: roles are written into "
                             f"the prompt by the template")
    merged: list[tuple[str, bool]] = []  # text between two specials is encoded as one
    for text, special in pieces:
        if merged and not special and not merged[-1][1]:
            merged[-1] = (merged[-1][0] + text, False)
        elif text:
            merged.append((text, special))
    return [(text, special) for text, special in merged if text]


def _fill(rendered: str, template_text: list[str], fields: list[str]) -> list[str] | None:
    """The text each placeholder became in `rendered`: the field as it is, or stripped."""
    if "".join(t + f for t, f in zip(template_text, [*fields, ""])) == rendered:
        return fields
    choices = ["|".join(re.escape(v) for v in dict.fromkeys((f, f.strip(), f.lstrip(),
                                                               f.rstrip()))) for f in fields]
    regex = "".join(re.escape(t) + (f"({c})" if i < len(choices) else "")
                    for i, (t, c) in enumerate(zip(template_text, [*choices, ""])))
    match = re.fullmatch(regex, rendered, flags=re.DOTALL)
    return list(match.groups()) if match else None


def _alternation(specials: Iterable[str]) -> re.Pattern[str] | None:
    """Leftmost-longest matching of the special tokens, as `tokenizers` splits them off."""
    names = sorted({s for s in specials if s}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, names))) if names else None
