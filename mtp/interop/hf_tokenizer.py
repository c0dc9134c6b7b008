"""Tokenizer files that transformers' `AutoTokenizer` loads, and SentencePiece conversion.

`ByteTokenizer` is written as a merge-less BPE over the 256 byte-level symbols in byte order
plus the six specials, which gives its ids for any text; the template puts before a text what
`encode_prompt` puts before a prompt. A SentencePiece `tokenizer.model` converts through
transformers (SentencePiece's ids, but text starting with whitespace gets no "▁" prefix).
"""

from __future__ import annotations

from pathlib import Path

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from mtp.interop.fields import require, write_json
from mtp.tokenizers import (BPE_FILE, META_FILE, BPETokenizer, ByteTokenizer, Tokenizer,
                            hf_chat_template, load_tokenizer)

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SENTENCEPIECE_FILE = "tokenizer.model"
BYTE_SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|reserved_0|>", "<|reserved_1|>",
                 "<|reserved_2|>")  # ids 256..261, in ByteTokenizer's order


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE symbols)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return {b: chr(b if b in printable else next(shifted)) for b in range(256)}


def byte_tokenizer_json() -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` giving `ByteTokenizer`'s ids for any text."""
    vocab = {symbol: byte for byte, symbol in byte_to_unicode().items()}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True) for name in BYTE_SPECIALS])
    return tok


def write_hf_tokenizer(tokenizer: Tokenizer, directory: Path, *, model_max_length: int) -> None:
    """Write `tokenizer` as files `AutoTokenizer` and `mtp.load` both read."""
    tokenizer.save(directory)  # mtp's header (+ tokenizer.json for BPE)
    if isinstance(tokenizer, ByteTokenizer):
        backend = byte_tokenizer_json()
        pad, bos, eos = (BYTE_SPECIALS[i - 256] for i in (tokenizer.pad_id, tokenizer.bos_id,
                                                          tokenizer.eos_id))
    elif isinstance(tokenizer, BPETokenizer):
        backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
        pad, bos, eos = tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token
    else:
        raise ValueError(f"no Hugging Face form for tokenizer {tokenizer!r}")
    start = tokenizer.document_start_id
    if not isinstance(tokenizer, BPETokenizer) or tokenizer.document_start != "tokenizer":
        # transformers >= 5 takes the template from tokenizer.json (add_bos_token is ignored
        # beside one): make it put the document start before every text.
        token = backend.id_to_token(start)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{token} $A", pair=f"{token} $A {token} $B", special_tokens=[(token, start)])
    backend.save(str(directory / BPE_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "pad_token": pad, "model_max_length": model_max_length,
              "add_bos_token": start is not None and start == tokenizer.bos_id,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              # mtp never makes a special token from text (mtp.tokenizers), nor will this unless
              # there is a chat template: engines render it and tokenize the prompt whole, so its
              # specials must become ids (in mtp, its own header keeps typed text text).
              "split_special_tokens": tokenizer.chat_template is None}
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    write_json(directory / TOKENIZER_CONFIG_FILE, config)


def read_hf_tokenizer(directory: Path) -> Tokenizer:
    """mtp's tokenizer files, a tokenizer.json, or a SentencePiece tokenizer.model."""
    if (directory / META_FILE).is_file() or (directory / BPE_FILE).is_file():
        return load_tokenizer(directory)
    if (directory / SENTENCEPIECE_FILE).is_file():
        return sentencepiece_tokenizer(directory)
    raise FileNotFoundError(f"no tokenizer in {directory}: looked for {META_FILE}, {BPE_FILE} "
                            f"and {SENTENCEPIECE_FILE}")


def sentencepiece_tokenizer(directory: Path, *, bos: bool = False) -> BPETokenizer:
    """The `tokenizer.model` in `directory`, converted as transformers converts Llama's; `bos`:
    prompts start with BOS whatever the template (as Meta's Llama code does)."""
    purpose = f"converting the SentencePiece {directory / SENTENCEPIECE_FILE}"
    require("sentencepiece", purpose)
    require("google.protobuf", purpose, package="protobuf")
    transformers = require("transformers", purpose)
    # transformers.LlamaTokenizer reads tokenizer.model itself and builds the equivalent
    # `tokenizers` pipeline (byte fallback, the leading-space rule).
    slow = transformers.LlamaTokenizer.from_pretrained(str(directory))
    return BPETokenizer(slow.backend_tokenizer, bos_token=slow.bos_token,
                        eos_token=slow.eos_token, name="sentencepiece",
                        document_start="bos" if bos else "tokenizer",
                        chat_template=hf_chat_template(
                            {"chat_template": getattr(slow, "chat_template", None)}, directory))
