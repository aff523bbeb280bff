"""Rematerialisation beyond the `remat=` option: what `remat="auto"` chose and
why ([`eqxscan.explain_auto`][] returns these `AutoChoice`s, judged by these
`THRESHOLDS`; `matmul_policy` is its matmul-saving policy), the fastest setting
that fits a memory budget (`fit_remat`, `remat_table`), one setting on every
scan (`with_remat`), and the timing they use (`time_interleaved`)."""

from .._internal import (
    AutoChoice as AutoChoice,
    matmul_policy as matmul_policy,
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
from ._devices import Peak as Peak, peak_of as peak_of
from ._timing import time_interleaved as time_interleaved
