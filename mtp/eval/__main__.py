"""`python -m mtp.eval task=mbpp checkpoint=DIR ...`: see conf/eval.yaml for every option."""

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from mtp.eval.runner import EvalConfig, evaluate
from mtp.paths import CONF_DIR


@hydra.main(config_path=str(CONF_DIR), config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Evaluate a checkpoint, or score a samples file, as `cfg` says; bad input is one line."""
    try:
        evaluate(EvalConfig(**OmegaConf.to_container(cfg, resolve=True)))
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
