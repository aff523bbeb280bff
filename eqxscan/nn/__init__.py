"""Ready-made models built on [`eqxscan.Stacked`][] and [`eqxscan.Recurrent`][]:
the residual MLP stack and a simple recurrent cell (also importable from the
top level: `eqxscan.StackedMLP`, `eqxscan.MLPBlock`, `eqxscan.ElmanCell`)."""

from ._elman import ElmanCell as ElmanCell
from ._mlp import MLPBlock as MLPBlock, rms_norm as rms_norm, StackedMLP as StackedMLP
