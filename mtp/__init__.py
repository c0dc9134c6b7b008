"""mtp: multi-token prediction pretraining and self-speculative decoding."""

from mtp.checkpoint import export_hf, load
from mtp.model import MTPConfig, MTPModel

__all__ = ["MTPConfig", "MTPModel", "export_hf", "load"]
