"""mtp: multi-token prediction pretraining and self-speculative decoding."""

from mtp.checkpoint import load
from mtp.model import MTPConfig, MTPModel

__all__ = ["MTPConfig", "MTPModel", "load"]
