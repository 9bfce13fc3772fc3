"""The benchmarks, a package so that its scripts import each other by name: run each from the repository root as
``python -m benchmarks.<folder>.<script>`` (with ``src`` on PYTHONPATH, or the package installed). Not shipped in
the wheel (setup.cfg finds packages under ``src`` only)."""
