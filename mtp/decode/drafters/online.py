"""Heads that keep learning while they draft: online speculative decoding (Liu et al. 2023).

`OnlineHeads` drafts as `HeadsDrafter` does; at the start of the next `generate` call it
takes `steps` optimizer steps on heads 1..depth over the sequences it drafted for, minimising
sum over heads i of mean_t KL(p_{t+i} || q_i,t) (head 0's distribution at t + i against head
i's at t). Nothing that verifies gets a gradient, so greedy output stays the target's and
sampling lossless. Parallel heads only: sequential modules read the tokens ahead.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mtp.cli import check_positive
from mtp.decode.drafters.base import Verified
from mtp.decode.drafters.heads import HeadsDrafter
from mtp.decode.sampling import SamplingConfig
from mtp.decode.tree import Tree
from mtp.kv_cache import KVCache
from mtp.model import MTPModel


class OnlineHeads(HeadsDrafter):
    """`HeadsDrafter` whose heads 1..depth learn from each call's finished sequences, at the
    start of the next call (`lr`: AdamW's learning rate; `steps`: optimizer steps each time)."""

    online = True
    rowwise = (*HeadsDrafter.rowwise, "_rows")  # `_rows`: the sequence of each batch row

    def __init__(self, k: int, tree: Tree | None = None, siblings: str = "distinct", *,
                 lr: float = 1e-4, steps: int = 1) -> None:
        super().__init__(k, tree, siblings)
        if not lr > 0:
            raise ValueError(f"online learning rate must be > 0, got lr={lr!r}")
        self.lr, self.steps = lr, check_positive("steps", steps)
        self.learnt = 0  # optimizer steps taken so far
        self.seconds = 0.0  # time spent learning
        self._texts: list[list[int]] = []  # this call's sequences, prompt and new tokens
        self._rows: list[int] = []  # the sequence of each batch row
        self._optimizer: torch.optim.Optimizer | None = None

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + ", online)"

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        if self._texts:
            self.learn(model, self._texts)
        self._texts = [list(prompt) for prompt in prompts]
        self._rows = list(range(len(prompts)))
        super().start(model, prompts, cache, sampling, generator)

    def update(self, step: Verified) -> None:
        for row, ids in enumerate(step.new_ids or []):
            self._texts[self._rows[row]].extend(ids)
        super().update(step)

    def learn(self, model: MTPModel, texts: list[list[int]]) -> float:
        """`steps` optimizer steps of heads 1..depth on `texts` (token ids); the last step's
        loss (before it)."""
        heads = [p for i in range(1, self.tree.depth + 1) for p in model.heads[i].parameters()]
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(heads, lr=self.lr, weight_decay=0.0)
        device = heads[0].device
        total, began = 0.0, time.perf_counter()
        with torch.inference_mode(False), torch.enable_grad():
            for p in heads:
                p.requires_grad_(True)
            texts = [ids[-model.config.max_seq_len:] for ids in texts]
            by_length: dict[int, list[list[int]]] = {}
            for ids in texts:  # texts of one length run as one batch
                by_length.setdefault(len(ids), []).append(ids)
            for _ in range(self.steps):
                total = 0.0
                for group in by_length.values():
                    tokens = torch.tensor(group, device=device)
                    loss = self._loss(model, tokens) * len(group) / len(texts)
                    if loss.requires_grad:  # one-token texts teach nothing
                        loss.backward()
                    total += loss.item()
                self._optimizer.step()
                self._optimizer.zero_grad(set_to_none=True)
                self.learnt += 1
        self.seconds += time.perf_counter() - began
        return total

    def _loss(self, model: MTPModel, tokens: torch.Tensor) -> torch.Tensor:
        """Sum over heads 1..depth of the mean KL(target || head) over the positions of a
        batch of equally long texts (B, T), averaged over the texts."""
        with torch.no_grad():
            trunk = model.trunk(tokens)
            target = F.log_softmax(model.unembed(model.head(trunk, 0)).float(), dim=-1)
        loss = torch.zeros((), device=tokens.device)
        for i in range(1, min(self.tree.depth, tokens.shape[1] - 1) + 1):
            head = F.log_softmax(model.unembed(model.head(trunk, i), i).float(), dim=-1)
            loss = loss + F.kl_div(head[:, :-i], target[:, i:], log_target=True,
                                   reduction="batchmean") / (tokens.shape[1] - i)  # per text
        return loss
