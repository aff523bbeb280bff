"""Benchmarks of eqxscan, run from a checkout of the repository (not installed).

`python -m benchmarks.bench` is the compile/step/memory benchmark against depth;
the other modules are single scripts, `python benchmarks/<name>.py`.
"""
