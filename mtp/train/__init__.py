"""Training: `python -m mtp.train +experiment=byte8` (`run.py`: compose, train, export,
summarise), the LightningModule around the multi-token loss, the optimiser and its schedule,
FSDP2, and what a run measures of itself (pace, memory, FLOPs, its summary and plots)."""
