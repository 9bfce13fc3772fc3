"""Compression cost: dense forwards, stack passes, seconds and memory, on the CPU and on a lent GPU."""
