"""Byte-level and BPE tokenizers behind one interface (`Tokenizer`), saved with every checkpoint.

- ``encode`` never adds special tokens nor makes one from text (``<|eos|>`` in a document
  stays text); the data pipeline places EOS. ``decode`` skips special tokens.
- Byte ids: 0..255 the raw bytes, pad=256, bos=257, eos=258, reserved 259..261 (vocab 262).
- BPE is byte-level, trained with ``tokenizers``; any ``tokenizer.json`` loads.
- Prompts (``encode_prompt``) start as the model saw every document start: after EOS for
  tokenizers mtp trains, else as their own template says (Llama's BOS, SmolLM2's nothing).
- Conversations (``encode_chat``): the model's chat template rendered as transformers does
  (``mtp.chat``); only the special tokens the template writes become their ids.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from mtp.chat import Conversation, is_conversation, render_chat
from mtp.paths import write_json

META_FILE = "mtp_tokenizer.json"  # our small header, next to tokenizer.json for BPE
BPE_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.50 saves the template

# A prompt: a text, or a conversation (a list of {"role", "content"} messages).
Prompt = str | bytes | Conversation

# Names tried, in order, when a tokenizer.json comes without our header.
_SPECIAL_CANDIDATES = {
    "bos": ("<|bos|>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "<|endoftext|>"),
    "eos": ("<|eos|>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>"),
    "pad": ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>"),
}


class IncrementalDecoder(Protocol):
    """Turns a stream of ids into text, emitting only complete characters."""

    def push(self, ids: Iterable[int]) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(ABC):
    """The interface every tokenizer implements."""

    name: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    # The model's Jinja chat template (None: the model has none), and the tokens it names.
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    stop_tokens: tuple[str, ...] = ()  # end-of-turn tokens besides EOS

    @abstractmethod
    def encode(self, text: str | bytes) -> list[int]:
        """Token ids of ``text``, without special tokens."""

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[list[int]]:
        """``encode`` applied to each text."""
        return [self.encode(text) for text in texts]

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are skipped."""

    @abstractmethod
    def incremental_decoder(self) -> IncrementalDecoder:
        """A fresh streaming decoder (see ``IncrementalDecoder``)."""

    @abstractmethod
    def save(self, directory: str | Path) -> None:
        """Write the files ``load_tokenizer(directory)`` reads back."""

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """Short string that changes whenever encoding would change (names caches)."""

    def encode_prompt(self, text: Prompt) -> list[int]:
        """The ids of a prompt as the model is given it: here EOS, then the text."""
        if is_conversation(text):
            return self.encode_chat(text)
        return [self.eos_id, *self.encode(text)]

    def encode_prompts(self, texts: Sequence[Prompt]) -> list[list[int]]:
        """``encode_prompt`` applied to each prompt (text or conversation)."""
        return [self.encode_prompt(text) for text in texts]

    def encode_chat(self, messages: Conversation, add_generation_prompt: bool = True,
                    **variables: Any) -> list[int]:
        """The ids of a conversation as transformers' ``apply_chat_template(messages,
        tokenize=True)`` gives them; ``variables``: more template variables (e.g. tools)."""
        if self.chat_template is None:
            raise ValueError(f"the {self.name} tokenizer has no chat template: give prompts "
                             f"as text, or use a model that has one")
        specials = self.special_tokens
        names = {name: getattr(self, name) for name in ("bos_token", "eos_token", "pad_token")}
        pieces = render_chat(self.chat_template, messages, specials,
                             add_generation_prompt=add_generation_prompt,
                             **{k: v for k, v in names.items() if v is not None}, **variables)
        return [i for text, special in pieces
                for i in ([specials[text]] if special else self.encode(text))]

    @property
    def special_tokens(self) -> dict[str, int]:
        """The special tokens a chat template may write, by their text."""
        return {}

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end a generation: EOS and any end-of-turn token (``stop_tokens``)."""
        found = self.special_tokens
        return frozenset((self.eos_id, *(found[t] for t in self.stop_tokens if t in found)))

    @property
    def document_start_id(self) -> int | None:
        """The token a prompt starts with (``encode_prompt``'s), or None when there is none."""
        ids, text = self.encode_prompt("a"), self.encode("a")
        return ids[0] if ids[:len(text)] != text else None

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset((self.bos_id, self.eos_id, self.pad_id))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: exact round trip for any byte string."""

    name = "byte"
    vocab_size = 262
    pad_id, bos_id, eos_id = 256, 257, 258

    def encode(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else bytes(text))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The exact bytes behind ``ids`` (special tokens skipped)."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif not 256 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the byte vocabulary "
                                 f"[0, {self.vocab_size})")
        return bytes(out)

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def incremental_decoder(self) -> IncrementalDecoder:
        return _Utf8IncrementalDecoder(self)

    def save(self, directory: str | Path) -> None:
        _write_meta(directory, {"kind": "byte"})

    @property
    def fingerprint(self) -> str:
        return "byte"


class _Utf8IncrementalDecoder:
    """Holds back a partial multi-byte UTF-8 sequence until its last byte arrives."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Iterable[int]) -> str:
        return self._utf8.decode(self._tokenizer.decode_bytes(ids))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


DOCUMENT_STARTS = ("eos", "bos", "tokenizer")


class BPETokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer``. ``document_start``, what starts a prompt:
    "eos" (tokenizers mtp trains), "tokenizer" (its own template), or "bos"."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None,
                 name: str = "bpe", document_start: str = "eos",
                 chat_template: str | None = None, stop_tokens: Sequence[str] = ()) -> None:
        if document_start not in DOCUMENT_STARTS:
            raise ValueError(f"document_start must be one of {DOCUMENT_STARTS}, got "
                             f"{document_start!r}")
        self._tok = tokenizer
        self.document_start = document_start
        # Text that spells a special token stays text, as with the byte tokenizer.
        self._tok.encode_special_tokens = True
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token or _find_special(tokenizer, "bos")
        self.eos_token = eos_token or _find_special(tokenizer, "eos")
        # Many released tokenizers (Llama) have no pad token; EOS is the usual stand-in,
        # and pads never reach a loss here anyway.
        self.pad_token = pad_token or _find_special(tokenizer, "pad", default=self.eos_token)
        self.bos_id, self.eos_id, self.pad_id = (
            _token_id(tokenizer, t) for t in (self.bos_token, self.eos_token, self.pad_token))
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be a string, got {chat_template!r:.80}")
        self.chat_template = chat_template or None
        self.stop_tokens = tuple(t for t in dict.fromkeys(stop_tokens) if t != self.eos_token)
        for token in self.stop_tokens:
            _token_id(tokenizer, token)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 32_000, *,
              min_frequency: int = 2) -> BPETokenizer:
        """Train a byte-level BPE on ``texts`` with pad, bos and eos as ids 0, 1, 2."""
        specials = ["<|pad|>", "<|bos|>", "<|eos|>"]
        base = 256 + len(specials)
        if vocab_size < base:
            raise ValueError(f"vocab_size={vocab_size} must be at least {base} (256 bytes + "
                             f"specials)")
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok, pad_token=specials[0], bos_token=specials[1], eos_token=specials[2])

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        """Load a ``tokenizer.json`` (or a folder holding one), e.g. a Llama tokenizer."""
        path = Path(path)
        file = path / BPE_FILE if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {file}")
        tok = tokenizers.Tokenizer.from_file(str(file))
        meta = _read_json(file.parent / META_FILE) or _hf_meta(file.parent, tok)
        # A foreign tokenizer.json (no header of ours): its own template starts prompts.
        return cls(tok, **{k: meta.get(k) for k in ("bos_token", "eos_token", "pad_token",
                                                     "chat_template")},
                   name=meta.get("name", "bpe"), stop_tokens=meta.get("stop_tokens", ()),
                   document_start=meta.get("document_start", "tokenizer"))

    def encode_prompt(self, text: Prompt) -> list[int]:
        if is_conversation(text) or self.document_start == "eos":
            return super().encode_prompt(text)
        if self.document_start == "bos":
            return [self.bos_id, *self.encode(text)]
        return self._tok.encode(self._text(text), add_special_tokens=True).ids

    def encode_prompts(self, texts: Sequence[Prompt]) -> list[list[int]]:
        if self.document_start != "tokenizer" or any(map(is_conversation, texts)):
            return [self.encode_prompt(t) for t in texts]
        batch = self._tok.encode_batch([self._text(t) for t in texts], add_special_tokens=True)
        return [e.ids for e in batch]

    @staticmethod
    def _text(text: str | bytes) -> str:
        if isinstance(text, bytes):
            try:
                return text.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"BPE tokenizer needs UTF-8 text; got invalid bytes ({e})") from e
        return text

    def encode(self, text: str | bytes) -> list[int]:
        return self._tok.encode(self._text(text), add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[list[int]]:
        if any(isinstance(t, bytes) for t in texts):
            return super().encode_batch(texts)
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def incremental_decoder(self) -> IncrementalDecoder:
        return _TextIncrementalDecoder(self)

    def save(self, directory: str | Path) -> None:
        directory = _write_meta(directory, {
            "kind": "bpe", "name": self.name, "bos_token": self.bos_token,
            "eos_token": self.eos_token, "pad_token": self.pad_token,
            "document_start": self.document_start,
            **({"chat_template": self.chat_template} if self.chat_template else {}),
            **({"stop_tokens": list(self.stop_tokens)} if self.stop_tokens else {})})
        self._tok.save(str(directory / BPE_FILE))

    @property
    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()
                if t.special}

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (do not change it: copy it)."""
        return self._tok

    @property
    def fingerprint(self) -> str:
        return hashlib.blake2b(self._tok.to_str().encode(), digest_size=8).hexdigest()


class _TextIncrementalDecoder:
    """Streaming decode: re-decode from one emission back (context-dependent decoders stay
    right); a trailing U+FFFD means a character is cut, so wait."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window re-decoded for context
        self._read = 0  # ids before this were already emitted

    def push(self, ids: Iterable[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        text = self._pending()
        if not text or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text

    def flush(self) -> str:
        text = self._pending()
        self._prefix = self._read = len(self._ids)
        return text

    def _pending(self) -> str:
        done = self._tokenizer.decode(self._ids[self._prefix : self._read])
        full = self._tokenizer.decode(self._ids[self._prefix :])
        return full[len(done) :]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load what ``Tokenizer.save`` wrote, or any folder or file with a ``tokenizer.json``."""
    path = Path(path)
    meta = _read_json(path / META_FILE) if path.is_dir() else None
    if meta is not None and meta.get("kind") == "byte":
        return ByteTokenizer()
    if (path / BPE_FILE).is_file() or path.is_file():
        return BPETokenizer.from_file(path)
    raise FileNotFoundError(f"no tokenizer at {path}: looked for {path / META_FILE} (kind "
                            f"'byte') and {path / BPE_FILE}")


def _write_meta(directory: str | Path, meta: dict) -> Path:
    return write_json(Path(directory) / META_FILE, {"format_version": 1, **meta}, indent=2).parent


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _hf_meta(directory: Path, tok: tokenizers.Tokenizer) -> dict:
    """A Hugging Face directory's special token names, chat template and end-of-turn tokens
    (``generation_config.json``'s list of eos_token_id)."""
    config = _read_json(directory / HF_CONFIG_FILE) or {}
    out: dict[str, Any] = {"chat_template": hf_chat_template(config, directory)}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    eos = (_read_json(directory / "generation_config.json") or {}).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    out["stop_tokens"] = [t for t in (tok.id_to_token(i) for i in ids if isinstance(i, int))
                          if t is not None]
    return out


def hf_chat_template(config: Mapping[str, Any], directory: Path | None = None) -> str | None:
    """The chat template of a ``tokenizer_config.json`` (a string, or a list of {name,
    template} of which "default" is taken), else of ``chat_template.jinja`` beside it."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and directory is not None and (directory / CHAT_TEMPLATE_FILE).is_file():
        template = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    return template if isinstance(template, str) and template else None


def _find_special(tok: tokenizers.Tokenizer, role: str, default: str | None = None) -> str:
    found = next((c for c in _SPECIAL_CANDIDATES[role] if tok.token_to_id(c) is not None),
                 default)
    if found is not None:
        return found
    raise ValueError(f"cannot find a {role} token: tried {list(_SPECIAL_CANDIDATES[role])}; "
                     f"pass {role}_token=... to BPETokenizer")


def _token_id(tok: tokenizers.Tokenizer, token: str) -> int:
    token_id = tok.token_to_id(token)
    if token_id is None:
        raise ValueError(f"special token {token!r} is not in the vocabulary")
    return token_id

