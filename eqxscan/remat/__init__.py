"""Rematerialisation beyond the `remat=` option: what `remat="auto"`
chose and why, and choosing a setting that fits a memory budget.

- [`eqxscan.remat.explain_auto`][] (also `eqxscan.explain_auto`): the choice of
  `"auto"` for every scan a function runs, with the rule that fired.
- [`eqxscan.remat.fit_remat`][] / [`eqxscan.remat.remat_table`][]: the fastest
  setting that fits a budget, from XLA's memory and cost analysis (or timing).
- [`eqxscan.remat.with_remat`][]: a model with one `remat=` setting on
  every scan in it (as a candidate's `apply` sets it).
- [`eqxscan.remat.time_interleaved`][]: the timing used by both and by the bench.
"""

from .._internal import (
    AutoChoice as AutoChoice,
    StepCost as StepCost,
    THRESHOLDS as THRESHOLDS,
    Thresholds as Thresholds,
)
from ._budget import (
    choose as choose,
    fit_remat as fit_remat,
    remat_table as remat_table,
    RematCandidate as RematCandidate,
    RematTable as RematTable,
    time_candidates as time_candidates,
    with_remat as with_remat,
)
from ._devices import peak_of as peak_of
from ._explain import explain_auto as explain_auto
from ._timing import time_interleaved as time_interleaved
