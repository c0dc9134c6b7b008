"""`python -m mtp.convert`: arguments, and a round trip through both commands in-process."""

from pathlib import Path

import pytest
import torch

from mtp import load
from mtp.checkpoint import export
from mtp.convert import main, parse_args
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer


@pytest.mark.parametrize("argv, message", [
    ([], "must be a command"),
    (["to_gguf", "checkpoint=a", "output=b"], "must be a command"),
    (["to_hf", "checkpoint=a"], "output=... is required"),
    (["to_hf", "checkpoint=a", "output=b", "shards=2"], "unknown key shards; known: "),
    (["to_hf", "checkpoint=a", "output=b", "dtype=int8"], "dtype='int8' is not one of"),
])
def test_bad_arguments_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_args(argv)


def test_to_hf_then_to_mtp_keeps_every_head(tmp_path: Path, tiny_config: MTPConfig) -> None:
    model = MTPModel(tiny_config).eval()
    export(model, ByteTokenizer(), tmp_path / "export")
    main(["to_hf", f"checkpoint={tmp_path / 'export'}", f"output={tmp_path / 'hf'}",
          "dtype=bfloat16"])
    main(["to_mtp", f"checkpoint={tmp_path / 'hf'}", f"output={tmp_path / 'back'}"])
    back, _ = load(tmp_path / "back")
    assert back.config == tiny_config
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(back.float()(torch.arange(12)[None]),
                               model.to(torch.bfloat16).float()(torch.arange(12)[None]))
