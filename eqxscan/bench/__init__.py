"""`python -m eqxscan.bench`: compile time, step time and memory of a StackedMLP
train step against depth, for eqxscan's options and its peers. Run it with
`--help` for the options; `docs/benchmarks.md` explains the numbers."""
