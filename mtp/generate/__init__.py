"""Self-speculative generation with the multi-token heads."""
