"""mtp: multi-token prediction pretraining and self-speculative decoding."""

from mtp.openmp import passive_waits

passive_waits()  # before torch loads its OpenMP runtime (mtp.openmp says why)

from mtp.checkpoint import export_hf, export_mimo, load  # noqa: E402
from mtp.model import MTPConfig, MTPModel  # noqa: E402

__all__ = ["MTPConfig", "MTPModel", "export_hf", "export_mimo", "load"]
