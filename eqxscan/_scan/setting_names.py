"""Settings in words and back, as the budget tools (`eqxscan.remat.fit_remat`,
`eqxscan.planning.plan`) read and print them: a byte budget such as `"6GiB"`
(`parse_bytes`), a number of bytes (`size_label`) and a `remat=` setting's name
(`remat_label`)."""

import re

import jax
import numpy as np

from .options import Remat
from .scan_remat import OFFLOAD_POLICY


#: Bytes per unit, by lower-case name: kB = 10**3 ... TB, KiB = 2**10 ... TiB.
_UNITS = {"": 1, "b": 1} | {
    f"{p}{i}b": (2**10 if i else 10**3) ** k
    for k, p in enumerate("kmgt", start=1)
    for i in ("", "i")
}


def parse_bytes(budget: int | np.integer | str) -> int:
    """`6 * 2**30`, `"6GiB"`, `"512MB"`, `"1.5 GB"` -> a number of bytes."""
    size = 0
    if isinstance(budget, int | np.integer) and not isinstance(budget, bool):
        size = int(budget)
    elif isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        if m and m.group(2).lower() in _UNITS:
            # "0.5B" is no byte: refused, not a budget nothing fits.
            size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size >= 1:
        return size
    raise ValueError(
        f"budget must be a positive int number of bytes or a string such as "
        f"'6GiB' or '512MB' (at least one byte), got {budget!r}.\nHint: units are "
        "B, kB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024)."
    )


def size_label(n: int) -> str:
    # KiB below a MiB: a small model's sizes would all read "0.00 MiB".
    if n < 2**10:  # "0.0 KiB" would read as nothing
        return f"{n} bytes"
    return f"{n / 2**10:.1f} KiB" if n < 2**20 else f"{n / 2**20:.2f} MiB"


def remat_label(remat: Remat) -> str:
    """`"auto"`, `"True"`, `"offload"`, or a policy's name in
    `jax.checkpoint_policies`."""
    if isinstance(remat, (str, bool)):
        return repr(remat) if isinstance(remat, str) else str(remat)
    if remat is OFFLOAD_POLICY:  # what `remat="offload"` resolves to
        return "'offload'"
    named = (n for n, v in vars(jax.checkpoint_policies).items() if v is remat)
    return next(named, getattr(remat, "__name__", repr(remat)))
