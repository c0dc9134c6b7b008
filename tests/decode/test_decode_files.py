"""One decode step reads in a few files: a call tracer counts every file of mtp/ that one
step enters (after warm-up), a greedy chain step and a sampled tree step alike."""

import sys
from pathlib import Path

import torch

import mtp
from mtp.decode.drafters.base import Drafter
from mtp.decode.drafters.eagle import EagleDrafter
from mtp.decode.drafters.eagle_model import Eagle, EagleConfig
from mtp.decode.tree import Tree
from mtp.generate import HeadsDrafter, SamplingConfig, generate
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer

PACKAGE = Path(mtp.__file__).parent


def _step_files(model: MTPModel, drafter: Drafter, step: int, **options) -> set[str]:
    """The files of mtp/ that decode step `step` (counted from 1 by the drafter's proposals)
    enters, from its proposal up to the next one."""
    propose = type(drafter).propose.__code__
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
                 drafter=drafter, **options)
    finally:
        sys.setprofile(None)
    assert proposals > step, f"the decode ended after {proposals} steps"
    return files


# The step: the loop (draft, verify and accept, commit, the outputs' stop and stream, which
# decodes the new tokens' text), the engine's step, its forward through the model (the
# model's blocks, the cache's writes and the step's positions), the acceptance rule and the
# drafter; the tree's buffers were built before the first step, and the records that travel
# between them have no methods to run. On a CPU the model's layers call the kernels' room.
STEP = {"decode/loop.py", "decode/engine.py", "decode/forward.py", "decode/acceptance.py",
        "decode/drafters/heads.py", "model.py", "kv_cache.py", "tokenizers.py",
        "kernels/__init__.py"}


def test_one_greedy_chain_step_enters_nine_files(tiny_config):
    torch.manual_seed(0)
    files = _step_files(MTPModel(tiny_config).eval(), HeadsDrafter(4), step=3)
    assert files <= STEP, sorted(files - STEP)
    assert len(files) <= 9


def test_one_sampled_tree_step_enters_ten_files(tiny_config):
    """A tree adds no file; sampling adds the one that draws from a distribution."""
    torch.manual_seed(0)
    tree = Tree(((0,), (1,), (0, 0), (1, 0)))
    files = _step_files(MTPModel(tiny_config).eval(), HeadsDrafter(4, tree), step=3,
                        sampling=SamplingConfig(temperature=0.8), seed=0)
    assert files <= STEP | {"decode/sampling.py"}, sorted(files - STEP)
    assert len(files) <= 10


def test_an_exact_mode_step_enters_no_more_files(tiny_config):
    """Exact mode is the plain step (on the kernels) or its fixed-width window: no room of
    its own, and none of the session's."""
    torch.manual_seed(0)
    files = _step_files(MTPModel(tiny_config).eval(), HeadsDrafter(4), step=3, exact=True)
    assert files <= STEP, sorted(files - STEP)
    assert len(files) <= 9


def test_an_eagle_step_enters_its_drafter_and_layer_in_place_of_the_heads():
    """EAGLE's step: the target's step without the heads, plus the drafter, its layer and the
    cached attention the layer shares with the model (the drafter's own tree is built
    before the first step)."""
    torch.manual_seed(0)
    config = MTPConfig(vocab_size=262, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                       max_seq_len=96)
    model = MTPModel(config).eval()
    drafter = EagleDrafter(Eagle(EagleConfig.for_target(config, 262)).eval(), 4)
    files = _step_files(model, drafter, step=3)
    eagle_step = (STEP - {"decode/drafters/heads.py"}) | {
        "decode/drafters/eagle.py", "decode/drafters/eagle_model.py", "decode/drafters/base.py"}
    assert files <= eagle_step, sorted(files - eagle_step)
    assert {"decode/drafters/eagle.py", "decode/drafters/eagle_model.py"} <= files
