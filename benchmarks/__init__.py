"""jem-plugin benchmarks: speed, memory and quality, side by side with reference implementations.

Run everything with ``python -m benchmarks.run_all --out benchmarks/results`` (``--quick`` for a
smoke run of seconds); each ``bench_*.py`` module also runs alone. See ``benchmarks/README.md``.
"""
