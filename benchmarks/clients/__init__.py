"""Downstream clients a compressed checkpoint is run through (`python -m benchmarks.clients.run`)."""
