"""`python -m benchmarks.bench`: compile time, step time and memory of a StackedMLP
or Transformer train step against depth, for eqxscan's options and its peers. Run
it with `--help` for the options; `docs/benchmarks.md` explains the numbers.

`python -m benchmarks.bench.meshes` compares the meshes and remat settings of a
decoder built from the same Transformer `Block` on `N` devices, through
`eqxscan.planning.plan` (`docs/planning.md`).

The benchmark's models, for scripts that measure something else on them:

- `Block`: the pre-norm Transformer block on `[B, T, D]`.
- `make_problem(model, num_layers, dim, batch, seq, dtype)`: the model
  (`"mlp"` or `"transformer"`) and one batch, as every implementation gets them.
- `mse`: the loss of every implementation.
- `rnn_problem(cell, hidden, steps, inputs, batch)` and `compile_step(loss,
  model, inputs)`: the grid's recurrent problem and its compiled train step.
"""

from ._grid import compile_step as compile_step, rnn_problem as rnn_problem
from ._impls import mse as mse
from ._measure import make_problem as make_problem
from ._transformer import Block as Block
