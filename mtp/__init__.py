"""mtp: multi-token prediction pretraining and self-speculative decoding."""

from mtp.checkpoint import export_hf, export_mimo, load
from mtp.model import MTPConfig, MTPModel

__all__ = ["MTPConfig", "MTPModel", "export_hf", "export_mimo", "load"]
