"""`generate`: prompts in, continuations out; the decode loop reads draft -> verify -> accept
-> commit (`_decode`), autoregressive decoding being the same loop with no drafts.

A prompt is encoded as [EOS] + its tokens (training packs documents each followed by EOS;
imported models start a prompt as their own tokenizer does), or, as a conversation, by the
chat template. Prompts are right-padded and prefilled together; each row accepts its own
number of tokens per step, and a finished row stays in the batch, masked, until the batch is
rebuilt smaller (`engine.rebuild_size`). A row stops at EOS or an end-of-turn token (kept in
`token_ids`, not in the text), a stop string (the text cut before it) or its budget
("length", or "context": the room left in `max_seq_len`). Text streams through the
tokenizer's incremental decoder, holding back what could still start a stop string.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from mtp.decode.acceptance import (Acceptance, AcceptanceRule, AcceptanceSettings,
                                   acceptance_rule)
from mtp.cli import check_flag, check_positive
from mtp.decode.drafters.base import Autoregressive, Drafter, Verified
from mtp.decode.engine import Engine, rebuild_size
from mtp.decode.output import DecodeStats, FinishReason, Generation, TextCallback
from mtp.decode.sampling import SamplingConfig
from mtp.decode.drafters.registry import DrafterSpec, make_drafter
from mtp.chat import check_conversation, is_conversation
from mtp.model import MTPModel
from mtp.tokenizers import Prompt, Tokenizer


def generate(model: MTPModel, tokenizer: Tokenizer, prompts: Sequence[Prompt], *,
             max_new_tokens: int = 256, drafter: Drafter | DrafterSpec | str | None = None,
             sampling: SamplingConfig = SamplingConfig(), stop: Sequence[str] | str = (),
             seed: int | None = None, on_text: TextCallback | None = None,
             acceptance: Acceptance = "exact", compile: bool = False, exact: bool = False,
             width: int | None = None) -> list[Generation]:
    """Continue each prompt; one `Generation` per prompt, in order.

    Args:
        prompts: texts, or conversations (lists of {"role", "content"} messages: the model's
            chat template renders each, with the assistant's turn opened), or both.
        drafter: None (autoregressive decoding), a `Drafter` (`HeadsDrafter(k, tree)`,
            `PromptLookup`, ...), a `DrafterSpec` or a registered name ("heads": every head).
            `mtp.generate.open_decoder` (or `Auto`) chooses one by measurement.
        sampling: temperature (0: greedy), top-k and top-p of head 0's distribution.
        acceptance: "exact" (SpecInfer's rule, lossless), "spectr" (SpecTr's, lossless),
            "typical" (Medusa's, not lossless), or a rule (`TypicalAcceptance(...)`,
            `acceptance.py`).
        stop: strings that end a generation; the returned text stops before them.
        seed: seeds this call's random draws (None: torch's global generator).
        on_text: called as on_text(prompt_index, text) with each new piece of text.
        compile: run the decode step compiled (`torch.compile`; CUDA graphs on a GPU).
        exact: exact mode (`engine.py`): every step `width` tokens wide (default: the
            drafter's widest step), so that greedy output equals `generate(drafter=None,
            exact=True, width=W)` bit for bit in any dtype, and seeded sampling its draws.
    """
    config = model.config
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    _check_arguments(config.vocab_size, tokenizer, prompts, max_new_tokens, sampling, stop)
    rule = acceptance_rule(acceptance)
    drafter = make_drafter(model, drafter) or Autoregressive()
    drafter.check(model, tokenizer)
    check_exact(exact, width, rule)
    if width is not None and width < drafter.tree.n_nodes:
        raise ValueError(f"width={width} is below {drafter!r}'s widest step of "
                         f"{drafter.tree.n_nodes} tokens (the last token and its drafts)")
    encoded = tokenizer.encode_prompts(prompts)
    for index, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {index} is empty and the {tokenizer.name} tokenizer puts "
                             f"no token before a prompt: there is nothing to continue from")
        if len(ids) >= config.max_seq_len:
            raise ValueError(
                f"prompt {index} is {len(ids)} tokens (with the tokenizer's special tokens), "
                f"which leaves no room in the model's context of max_seq_len="
                f"{config.max_seq_len} tokens")

    tree = drafter.tree
    started = time.perf_counter()
    outputs = []
    for index, ids in enumerate(encoded):
        room = config.max_seq_len - len(ids)
        outputs.append(SequenceOutput(
            index, tokenizer, budget=min(max_new_tokens, room),
            budget_reason="length" if max_new_tokens <= room else "context", stop=stop,
            positions=tree.depth + 1, on_text=on_text, started=started))
    context = min(config.max_seq_len, max(map(len, encoded)) + max_new_tokens)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    elif exact and not sampling.greedy:  # a seed of torch's global generator: reproducible
        seed = int(torch.randint(2 ** 62, ()))
    with torch.inference_mode():  # every tensor of the call alike (a compiled step's guards)
        engine = Engine(model, len(encoded), context, tree, drafter.verify_heads(model),
                        acceptance=AcceptanceSettings(sampling, rule, exact),
                        compile=compile, width=width, seed=seed or 0,
                        layers=drafter.verify_layers(model))
        drafter.start(model, encoded, engine.cache, sampling, generator)
        _decode(engine, drafter, outputs, generator, tokenizer.pad_id, encoded)
    return [output.result() for output in outputs]


def _decode(engine: Engine, drafter: Drafter, outputs: list[SequenceOutput],
            generator: torch.Generator | None, pad_id: int, prompts: list[list[int]]) -> None:
    """The decode loop (see the module docstring); fills `outputs`."""
    batch = _Batch(engine, drafter, outputs)
    verified = engine.prefill(prompts, generator, pad_id)
    live = batch.commit(verified, [(0, False)] * engine.batch, nodes=1)  # it verified one
    while live:
        drafts = drafter.propose()  # draft
        verified, drafted = engine.verify_and_accept(drafts, generator)  # verify, accept
        live = batch.commit(verified, drafted, nodes=verified.pending.shape[1])  # commit


class _Batch:
    """The rows of the batch and the output each belongs to; commits what a step kept."""

    def __init__(self, engine: Engine, drafter: Drafter, outputs: list[SequenceOutput]) -> None:
        self.engine, self.drafter, self.outputs = engine, drafter, outputs
        self.rows = list(range(engine.batch))  # the output of each batch row

    def commit(self, verified: Verified, drafted: list[tuple[int, int]], nodes: int) -> bool:
        """The drafter hears what was kept, each row's output takes its new tokens, finished
        rows are masked (and leave when the batch is rebuilt); whether any row decodes on.
        `drafted`: each row's (real drafts, whether its kept node has children)."""
        engine, tree = self.engine, self.drafter.tree
        self.drafter.update(verified)
        finished = []
        for row, (ids, (real, grows)) in enumerate(zip(verified.new_ids, drafted)):
            if not ids:  # finished before this step
                continue
            # Verified drafts: a chain's real ones up to the first rejected (the prefill
            # drafted none); a tree's kept path, and the depth after it if its node has children.
            checked = min(len(ids), real) if tree.is_chain or real == 0 else len(ids) - 1 + grows
            output = self.outputs[self.rows[row]]
            output.count_forward(checked, len(ids) - 1, nodes=nodes)
            if output.add(ids):
                finished.append(row)
        if finished:
            engine.finish(finished)
        live = [row for row, active in enumerate(engine.host_active) if active]
        size = rebuild_size(len(live), engine.batch, engine.compiled, engine.windowed)
        if live and size is not None:  # finished rows leave; padding rows (if any) stay masked
            kept = live + [row for row in range(engine.batch) if row not in live][:size - len(live)]
            engine.keep(kept)
            self.drafter.keep(kept)
            self.rows = [self.rows[row] for row in kept]
        return bool(live)


class SequenceOutput:
    """Accumulates one sequence's accepted tokens; decides when it is finished."""

    def __init__(self, index: int, tokenizer: Tokenizer, *, budget: int,
                 budget_reason: FinishReason, stop: Sequence[str], positions: int,
                 on_text: TextCallback | None, started: float) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self._stops = tokenizer.stop_ids  # EOS and end-of-turn tokens
        self._decoder = tokenizer.incremental_decoder()
        self._budget, self._budget_reason = budget, budget_reason
        self._stop, self._on_text, self._started = tuple(stop), on_text, started
        self._emitted = 0  # characters of `text` already given to on_text
        self._seconds, self._forwards, self._nodes = 0.0, 0, 0
        # Per draft position 0..positions-1: drafts verified, accepted; forwards by accepted.
        self._verified, self._accepted, self._depths = ([0] * positions for _ in range(3))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, ids: Sequence[int]) -> bool:
        """Take a step's accepted tokens in order, up to the first stop; True once finished."""
        for token in ids:
            self.token_ids.append(token)
            if token in self._stops:
                self._finish("eos")
                break
            self._append_text(self._decoder.push((token,)))
            if self.finished:
                break
            if len(self.token_ids) == self._budget:
                self._finish(self._budget_reason)
                break
        self._stream()
        return self.finished

    def count_forward(self, verified_drafts: int, accepted_drafts: int, nodes: int) -> None:
        """Record one forward pass of `nodes` tokens that verified drafts of heads
        1..verified_drafts and kept `accepted_drafts` of them."""
        self._forwards += 1
        self._nodes += nodes
        self._depths[accepted_drafts] += 1
        for head in range(verified_drafts + 1):  # head 0's token: always verified and kept
            self._verified[head] += 1
            self._accepted[head] += head <= accepted_drafts

    def result(self) -> Generation:
        if self.finish_reason is None:
            raise RuntimeError(f"sequence {self.index} has not finished")
        stats = DecodeStats.counted(
            forwards=self._forwards, tokens=len(self.token_ids), accepted=self._accepted,
            verified=self._verified, seconds=self._seconds, depths=self._depths, nodes=self._nodes)
        return Generation(self.text, list(self.token_ids), self.finish_reason, stats)

    def _append_text(self, piece: str) -> None:
        if not piece:
            return
        searched_from = max(0, len(self.text) - max(map(len, self._stop), default=0) + 1)
        self.text += piece
        hits = [i for i in (self.text.find(s, searched_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self._finish("stop")

    def _finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        if reason != "stop":
            self._append_text(self._decoder.flush())  # may still complete a stop string
        self._seconds = time.perf_counter() - self._started

    def _stream(self) -> None:
        if self._on_text is None:
            return
        end = len(self.text) if self.finished else len(self.text) - self._held_back()
        if end > self._emitted:
            self._on_text(self.index, self.text[self._emitted:end])
            self._emitted = end

    def _held_back(self) -> int:
        """Length of the longest tail of the text that a stop string could still start with."""
        return max((n for s in self._stop for n in range(len(s) - 1, 0, -1)
                    if self.text.endswith(s[:n])), default=0)


def check_exact(exact: bool, width: int | None, rule: AcceptanceRule | None) -> None:
    """Exact mode's settings, before anything loads or decodes (one-line errors); `rule`
    None: not chosen yet."""
    check_flag("exact", exact)
    if exact and rule is not None and not rule.exact_mode:
        raise ValueError(f"acceptance={rule.name} is a rule of its own: exact mode keeps a "
                         f"draft when it is the target's own token (acceptance=exact)")
    if width is not None and not exact:
        raise ValueError(f"width={width} sizes exact mode's steps: give exact=True with it")
    if width is not None:
        check_positive("width", width)


def _check_arguments(vocab_size: int, tokenizer: Tokenizer, prompts: Sequence[Prompt],
                     max_new_tokens: int, sampling: SamplingConfig,
                     stop: tuple[str, ...]) -> None:
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(f"the tokenizer ({tokenizer!r}) has {tokenizer.vocab_size} tokens but "
                         f"the model's vocab_size is {vocab_size}: they do not belong together")
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings or conversations, got "
                         f"{prompts!r:.80}")
    for index, prompt in enumerate(prompts):
        if is_conversation(prompt):
            check_conversation(prompt, f"prompt {index}")
            if tokenizer.chat_template is None:
                raise ValueError(f"prompt {index} is a conversation but the {tokenizer.name} "
                                 f"tokenizer has no chat template: give prompts as text")
        elif not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompt {index} must be a non-empty string, got {prompt!r:.80}")
    check_positive("max_new_tokens", max_new_tokens)
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {sampling!r}")
    for string in stop:
        if not isinstance(string, str) or not string:
            raise ValueError(f"stop strings must be non-empty strings, got {string!r}")
