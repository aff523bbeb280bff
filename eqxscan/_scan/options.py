"""`ScanOptions` (mode, rematerialisation, unroll), which every scanning module
holds, and `Scanning`, its base, which gives it `with_options`."""

import abc
from collections.abc import Mapping
from typing import cast, Literal, TypeAlias, TypedDict, TypeVar, Unpack

import equinox as eqx
import numpy as np
from jax.sharding import Sharding
from jaxtyping import PyTree

from .._helpers.checks import check_option, check_unroll, Checked
from .drop_rates import Rates
from .scan_remat import as_scan_remat, Policy, ScanRemat


Mode: TypeAlias = Literal["scan", "loop"]
"""`"scan"` runs `jax.lax.scan` (one traced body); `"loop"` a Python loop over the
same weights (the reference and debugging path)."""

Remat: TypeAlias = bool | Literal["auto", "nested", "offload"] | Policy | ScanRemat
"""Rematerialisation of each scan step: `False`, `True`, `"auto"`, `"nested"`,
`"offload"`, a `jax.checkpoint_policies` policy, or a [`eqxscan.ScanRemat`][]
(a policy plus what to do with each step's carry and inputs, and the nesting).
See the remat guide."""


Unroll: TypeAlias = int | bool | Literal["auto"]


class ScanArgs(TypedDict, total=False):
    """The keyword arguments `mode=`, `remat=` and `unroll=` that every
    scanning module's constructor takes (as `**options`), defined once."""

    mode: Mode
    remat: Remat
    unroll: Unroll


class OwnOptions(TypedDict, total=False):
    """The options of a scanning module besides its `ScanOptions` (each takes
    those it names in `own_options`)."""

    layer_sharding: Sharding | PyTree[Sharding | None] | None
    drop_path: Rates
    layer_drop: Rates
    reverse: bool
    method: Literal["auto", "sequential", "associative", "chunked"]
    chunk_size: int | Literal["auto"]


class OptionChanges(ScanArgs, OwnOptions, total=False):
    """The keyword arguments of `with_options`."""


OPTION_NAMES = ("mode", "remat", "unroll")


class ScanOptions(eqx.Module):
    """How a scanning module runs its layers or time steps. Frozen and validated
    once, when it is made; every scanning module holds one as `.options`.

    !!! example

        ```python
        import eqxscan

        options = eqxscan.ScanOptions(mode="loop", remat=True)
        assert options.replace(unroll=2).unroll == 2
        ```
    """

    mode: Mode = eqx.field(static=True)
    remat: Remat = eqx.field(static=True)
    unroll: Unroll = eqx.field(static=True)
    #: `remat` as the one `ScanRemat` the engine, the `"auto"` rule
    #: and the budget tools read (made once, here; `remat` stays as given).
    scan_remat: ScanRemat = eqx.field(static=True, repr=False)

    def __init__(
        self,
        mode: Checked[Mode] = "scan",
        remat: Checked[Remat] = "auto",
        unroll: Checked[Unroll] = "auto",
    ):
        """**Arguments:**

        - `mode`: a [`eqxscan.Mode`][]: `"scan"` or `"loop"`.
        - `remat`: a [`eqxscan.Remat`][] value.
        - `unroll`: a positive int, passed to `jax.lax.scan`; `True` to unroll
          fully (the program of `mode="loop"`, with this `remat`); or
          `"auto"` (chosen with `remat="auto"`'s rule; see
          [`eqxscan.explain_auto`][]).

        **Raises:**

        `ValueError` or `TypeError` naming the option, the value and what is
        allowed. (Values are checked here, not by the annotations, so the
        message is the same with or without a runtime type checker.)
        """
        check_option("mode", mode, ("scan", "loop"))
        self.scan_remat = as_scan_remat(remat)
        check_unroll(unroll)
        self.mode = mode
        # NumPy's bool as Python's: a static field holds no array.
        self.remat = bool(remat) if isinstance(remat, np.bool_) else remat
        self.unroll = unroll

    @classmethod
    def given(
        cls, what: str, options: ScanArgs, own: tuple[str, ...], hint: str = ""
    ) -> "ScanOptions":
        """The options among a container's keyword arguments, any name but
        theirs and `own` (its other keywords) refused, naming `what`."""
        check_names(options, (*own, *OPTION_NAMES), what, hint)
        return cls(**options)

    def as_args(self) -> ScanArgs:
        """These options as the keyword arguments of a scanning module."""
        return ScanArgs(mode=self.mode, remat=self.remat, unroll=self.unroll)

    def replace(self, **changes: Unpack[ScanArgs]) -> "ScanOptions":
        """A copy with `changes` (any of `mode`, `remat`, `unroll`) applied,
        validated like a new one."""
        check_names(changes, OPTION_NAMES, "ScanOptions.replace")
        return ScanOptions(**(self.as_args() | changes))


def check_names(
    given: Mapping[str, object], allowed: tuple[str, ...], what: str, hint: str = ""
) -> None:
    """Raise the `TypeError` Python raises for an unknown keyword argument."""
    for name in given:
        if name not in allowed:
            raise TypeError(
                f"{what}() got an unexpected keyword argument {name!r}; it takes "
                f"{', '.join(allowed)}." + (f"\nHint: {hint}" if hint else "")
            )


ScanningT = TypeVar("ScanningT", bound="Scanning")


class Scanning(eqx.Module):
    """Base of the modules that run the scan engine: each holds one
    [`eqxscan.ScanOptions`][] as `options`, readable as `.mode`, `.remat`
    and `.unroll`, and changed with `with_options`."""

    options: eqx.AbstractVar[ScanOptions]

    @property
    def mode(self) -> Mode:
        return self.options.mode

    @property
    def remat(self) -> Remat:
        return self.options.remat

    @property
    def unroll(self) -> Unroll:
        return self.options.unroll

    def with_options(self: ScanningT, **changes: Unpack[OptionChanges]) -> ScanningT:
        """A copy with the same weights and new options; options not given are kept.

        **Arguments:**

        - `mode`, `remat`, `unroll`: as for [`eqxscan.Stacked`][].
        - Any option of the module's own (`layer_sharding` of a `Stacked`;
          `drop_path` and `layer_drop` of a `Stacked`, `Chain` or `StackedMLP`;
          `reverse`, `method` and `chunk_size` of a `Recurrent`).

        **Returns:**

        A module of the same type sharing this one's arrays.
        """
        scan = cast(ScanArgs, {k: changes.pop(k) for k in OPTION_NAMES if k in changes})
        check_names(changes, OPTION_NAMES + self.own_options(), "with_options")
        return self.replace_options(self.options.replace(**scan), **changes)

    @abc.abstractmethod
    def own_options(self) -> tuple[str, ...]:
        """Names of the options besides `ScanOptions` that `with_options` takes."""

    @abc.abstractmethod
    def replace_options(
        self: ScanningT, options: ScanOptions, **own: Unpack[OwnOptions]
    ) -> ScanningT:
        """This module with `options` (and its own options `own`) in place."""
