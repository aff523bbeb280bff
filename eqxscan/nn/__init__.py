"""Ready-made models built on [`eqxscan.Stacked`][] and [`eqxscan.Recurrent`][]:
the residual MLP stack, a simple recurrent cell and cells with a linear
recurrence (also importable from the top level: `eqxscan.StackedMLP`,
`eqxscan.MLPBlock`, `eqxscan.ElmanCell`, `eqxscan.LRU`, `eqxscan.MinGRU`,
`eqxscan.GatedLinearAttention`)."""

from ._elman import ElmanCell as ElmanCell
from ._gla import GatedLinearAttention as GatedLinearAttention
from ._linear_rnn import LRU as LRU, MinGRU as MinGRU
from ._mlp import MLPBlock as MLPBlock, rms_norm as rms_norm, StackedMLP as StackedMLP
