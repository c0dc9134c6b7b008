"""One decode step reads in a few files: a call tracer counts the files of mtp/decode/ that
one greedy chain step (HeadsDrafter(k=4), batch 1, eager) enters, after warm-up."""

import sys
from pathlib import Path

import torch

import mtp.decode
from mtp.generate import HeadsDrafter, generate
from mtp.model import MTPModel
from mtp.tokenizers import ByteTokenizer

PACKAGE = Path(mtp.decode.__file__).parent


def _step_files(model: MTPModel, step: int) -> set[str]:
    """The files under mtp/decode/ that decode step `step` (counted from 1 by the drafter's
    proposals) enters, from its proposal up to the next one."""
    propose = HeadsDrafter.propose.__code__
    proposals, files = 0, set()

    def profile(frame, event, arg):
        nonlocal proposals
        if event != "call":
            return
        if frame.f_code is propose:
            proposals += 1
        path = Path(frame.f_code.co_filename)
        if proposals == step and path.is_relative_to(PACKAGE):
            files.add(path.relative_to(PACKAGE).as_posix())

    sys.setprofile(profile)
    try:
        generate(model, ByteTokenizer(), ["def add(a, b):"], max_new_tokens=40,
                 drafter=HeadsDrafter(4))
    finally:
        sys.setprofile(None)
    assert proposals > step, f"the decode ended after {proposals} steps"
    return files


def test_one_chain_step_enters_five_files(tiny_config):
    """The loop (decode.py: draft, verify and accept, commit, the outputs' stop and stream),
    the engine's step (engine.py), its forward (forward.py), the acceptance rule
    (acceptance.py) and the drafter (drafters/heads.py); the tree's buffers were built
    before the first step, and the records that travel between them have no methods to run."""
    torch.manual_seed(0)
    model = MTPModel(tiny_config).eval()
    files = _step_files(model, step=3)
    assert files <= {"loop.py", "engine.py", "forward.py", "acceptance.py",
                     "drafters/heads.py"}, sorted(files)
    assert len(files) <= 5
