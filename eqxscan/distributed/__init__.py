"""Several processes, one program: joining a multi-process JAX job with clear
errors when it does not form or a process is lost, checking every process runs
the same job, and each process's rows of a global batch. Not imported by
`import eqxscan`; `eqxscan.sharding` places the arrays; see `docs/multihost.md`.
"""

from ._runtime import (
    check_same_job as check_same_job,
    initialize as initialize,
    local_rows as local_rows,
)
