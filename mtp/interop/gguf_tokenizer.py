"""The tokenizer of a GGUF file's `tokenizer.ggml.*` metadata, rebuilt as a `tokenizers`
pipeline: `gpt2` (byte-level BPE, the split regex grouped by `tokenizer.ggml.pre` as
llama.cpp's llama-vocab.cpp groups it) or `llama` (SentencePiece BPE, merges rebuilt from the
scores as transformers' `generate_merges` orders them). As in transformers and llama.cpp,
CONTROL tokens are special, USER_DEFINED ones matched whole, BOS/EOS placed as
`add_bos_token`/`add_eos_token` say, and `eot_token_id` is a stop token beside EOS.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from mtp.interop.hf_tokenizer import byte_to_unicode
from mtp.tokenizers import BPETokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # gguf.TokenType

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> how text is split before byte-level BPE, by llama.cpp's groups:
# "gpt2" is GPT-2's regex; "digits" splits every digit off first (StarCoder, SmolLM);
# "llama3" and "qwen2" are those models' regexes (digits in threes, or one by one).
PRE_TOKENIZERS = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo"), "gpt2"),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"), "digits"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), "qwen2"),
}


def gguf_tokenizer(metadata: dict[str, Any], path: Path) -> BPETokenizer:
    """The tokenizer of a GGUF file from its metadata; a ValueError naming a missing or
    unsupported `tokenizer.ggml.*` field."""
    kind = _get(metadata, path, "model", str)
    tokens = _get(metadata, path, "tokens", list)
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
                         f"{len(tokens)} tokens")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not one mtp rebuilds "
                         f"('gpt2': byte-level BPE, 'llama': SentencePiece)")
    build = _byte_level if kind == "gpt2" else _sentencepiece
    tok, specials = build(metadata, path, tokens, types)
    tok.add_special_tokens(specials)
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    names = {}
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                      ("pad", "padding_token_id")):
        index = metadata.get(f"tokenizer.ggml.{key}")
        if index is None and role != "pad":
            raise ValueError(f"{path}: tokenizer.ggml.{key} is missing")
        if index is not None and not 0 <= index < len(tokens):
            raise ValueError(f"{path}: tokenizer.ggml.{key}={index} is outside the "
                             f"{len(tokens)}-token vocabulary")
        names[role] = None if index is None else tokens[index]
    tok.post_processor = _template(names["bos"] if add_bos else None,
                                   names["eos"] if metadata.get(
                                       "tokenizer.ggml.add_eos_token", False) else None, tok)
    # llama.cpp stops at EOS and at the end-of-turn token (EOT) where the file names one.
    eot = metadata.get("tokenizer.ggml.eot_token_id")
    stops = [tokens[eot]] if isinstance(eot, int) and 0 <= eot < len(tokens) else []
    return BPETokenizer(tok, bos_token=names["bos"], eos_token=names["eos"],
                        pad_token=names["pad"] or names["eos"], name=f"gguf-{kind}",
                        document_start="tokenizer", stop_tokens=stops,
                        chat_template=metadata.get("tokenizer.chat_template"))


def _get(metadata: dict[str, Any], path: Path, key: str, kind: type) -> Any:
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is None:
        raise ValueError(f"{path}: tokenizer.ggml.{key} is missing: the file carries no "
                         f"tokenizer mtp can rebuild")
    if not isinstance(value, kind):
        raise ValueError(f"{path}: tokenizer.ggml.{key} must be a {kind.__name__}, got "
                         f"{type(value).__name__}")
    return value


def _byte_level(metadata: dict[str, Any], path: Path, tokens: list[str],
                types: list[int]) -> tuple[tokenizers.Tokenizer, list[AddedToken]]:
    pre = metadata.get("tokenizer.ggml.pre")
    group = PRE_TOKENIZERS.get(pre)
    if group is None:
        raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer mtp "
                         f"knows; known: {sorted(PRE_TOKENIZERS)}")
    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (a control token written plainly) is respelled
    # byte by byte, as transformers does, so the BPE model can hold it.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in _get(metadata, path, "merges", list)]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges,
                                          ignore_merges=group == "llama3"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=group in (
        "gpt2", "digits"))
    if group == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif group in ("llama3", "qwen2"):
        split = _LLAMA3_SPLIT if group == "llama3" else _QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok, _added(tokens, types, vocab, alphabet)


def _sentencepiece(metadata: dict[str, Any], path: Path, tokens: list[str],
                   types: list[int]) -> tuple[tokenizers.Tokenizer, list[AddedToken]]:
    scores = _get(metadata, path, "scores", list)
    if len(scores) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.scores has {len(scores)} entries for "
                         f"{len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = metadata.get("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ")) for m in merges] if merges else _merges_by_score(
        vocab, dict(zip(tokens, scores)))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True,
                                          byte_fallback=True))
    prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok, _added(tokens, types, vocab)


def _added(tokens: list[str], types: list[int], vocab: dict[str, int],
           alphabet: set[str] | None = None) -> list[AddedToken]:
    """CONTROL tokens as specials (but for mislabels spelled outside a byte-level `alphabet`,
    as transformers), then USER_DEFINED ones the vocabulary holds, matched whole in text."""
    specials = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types)
                if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    return specials + [AddedToken(t, special=False, normalized=False)
                       for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab]


def _merges_by_score(vocab: dict[str, int],
                     scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges: every split of a token into two tokens, by the merged
    token's score, ties as transformers' `generate_merges` breaks them."""
    merges = []
    for token, score in scores.items():
        pairs = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges += sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))
    merges.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _template(bos: str | None, eos: str | None,
              tok: tokenizers.Tokenizer) -> processors.TemplateProcessing:
    """BOS and/or EOS around a text, as transformers' `update_post_processor` builds them."""
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1",
                     *([f"{eos}:1"] if eos else [])])
    specials = [(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=list(dict.fromkeys(specials)))
