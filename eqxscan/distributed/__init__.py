"""Several processes, one program: joining a multi-process JAX job with clear
errors when it does not form or a process is lost, checking every process runs
the same job, and each process's rows of a global batch.

Imported on first use (`eqxscan.distributed`), not by `import eqxscan`. Arrays
are placed on a mesh spanning the processes by `eqxscan.sharding`; see
`docs/multihost.md`.
"""

from ._runtime import (
    check_same_job as check_same_job,
    initialize as initialize,
    local_rows as local_rows,
)
