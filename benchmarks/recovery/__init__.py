"""Healing after compression: the runs, their default protocol, curves and probes."""
