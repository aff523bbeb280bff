"""What a plan returns: each compiled candidate's figures (`MeshCandidate`), the
whole plan and its Markdown table (`MeshPlan`), and the device figures its
estimate assumes (`Accelerator`, `ACCELERATORS`)."""

import dataclasses
import math
from typing import Any, NamedTuple, TypeAlias

from ..remat import peak_of


#: `(data, fsdp, model)`: the sizes of the three mesh axes.
MeshShape: TypeAlias = tuple[int, int, int]


class Accelerator(NamedTuple):
    """What the estimate assumes of one device."""

    flops: float
    """Peak dense bfloat16 FLOP/s."""
    link_bytes_per_s: float
    """Bytes per second one device sends to its peers (one direction, all links)."""


def _flops(device_kind: str) -> float:
    peak = peak_of(device_kind)
    assert peak is not None, device_kind  # every name below is in the table
    return peak.flops


#: Datasheet figures: dense bf16 peak (as `eqxscan.remat`'s table) and the
#: device-to-device bandwidth of one chip, one direction (NVLink; TPU ICI).
ACCELERATORS: dict[str, Accelerator] = {
    "B200": Accelerator(_flops("B200"), 900e9),
    "H200": Accelerator(_flops("H200"), 450e9),
    "H100": Accelerator(_flops("H100"), 450e9),
    "A100": Accelerator(_flops("A100"), 300e9),
    "TPU v6e": Accelerator(_flops("TPU v6 lite"), 448e9),
    "TPU v5p": Accelerator(_flops("TPU v5"), 600e9),
    "TPU v5e": Accelerator(_flops("TPU v5 lite"), 200e9),
    "TPU v4": Accelerator(_flops("TPU v4"), 300e9),
}


@dataclasses.dataclass(frozen=True)
class MeshCandidate:
    """One compiled (mesh, remat) candidate and XLA's figures per device.

    **Fields:**

    - `mesh`: `(data, fsdp, model)` axis sizes; `remat`: the setting in words.
    - `state_bytes`: parameters + optimiser state held by each device (the
      largest over devices), from the shardings.
    - `argument_bytes`, `output_bytes`, `alias_bytes`, `temp_bytes`: from
      `memory_analysis()` (outputs alias the donated parameters and state).
    - `flops`, `bytes_accessed`: `cost_analysis()`, which counts a loop body once.
    - `matmul_flops`, `collective_bytes`: the FLOPs of the dots and the result
      bytes of each kind of collective (`(kind, bytes)` pairs) per step, read
      from the compiled HLO with loop bodies counted once per iteration.
    - `compile_s`: seconds to lower and compile.
    - `estimated_s`: see [`eqxscan.planning.MeshPlan`][].
    - `error`: why the candidate could not be compiled, else `None`.
    """

    mesh: MeshShape
    remat: str
    state_bytes: int = 0
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    matmul_flops: float = 0.0
    collective_bytes: tuple[tuple[str, int], ...] = ()
    compile_s: float = 0.0
    estimated_s: float = math.inf
    error: str | None = None

    @property
    def device_bytes(self) -> int:
        """Argument + output - aliased + temp bytes: the peak each device holds."""
        if self.error is not None:
            return 0
        return (
            self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
        )

    @property
    def total_collective_bytes(self) -> int:
        return sum(b for _, b in self.collective_bytes)

    # JSON: how a candidate compiled in a fresh process comes back.
    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "MeshCandidate":
        pairs = tuple((k, int(b)) for k, b in d["collective_bytes"])
        return cls(**{**d, "mesh": tuple(d["mesh"]), "collective_bytes": pairs})


_NAMED = ("all-gather", "all-reduce", "reduce-scatter")  # a column each


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """Every candidate of an [`eqxscan.planning.plan`][] call, and the choice.
    `str(plan)` is a Markdown table.

    The estimate of a step's seconds, which ranks candidates and is no step
    time, is `matmul_flops / accelerator.flops` plus every collective's bytes
    at the link bandwidth (an all-reduce's twice, as a ring does), no overlap.

    **Fields:**

    - `devices`: `N`; `budget`: bytes per device.
    - `candidates`: every candidate, in the order compiled.
    - `chosen`: the fitting candidate with the lowest estimate, or `None` if
      none fits.
    - `accelerator`, `accelerator_name`: the figures the estimate assumes.
    - `simulated`: how the `N` devices were provided.
    - `seconds`: the whole plan's wall time.
    """

    devices: int
    budget: int
    candidates: tuple[MeshCandidate, ...]
    chosen: MeshCandidate | None
    accelerator_name: str
    accelerator: Accelerator
    simulated: str
    seconds: float

    @property
    def message(self) -> str:
        if self.chosen is not None:
            c = self.chosen
            return (
                f"chosen: data={c.mesh[0]} fsdp={c.mesh[1]} model={c.mesh[2]}, "
                f"remat={c.remat}"
            )
        sizes = [c.device_bytes for c in self.candidates if c.error is None]
        if not sizes:
            reason = self.candidates[0].error if self.candidates else None
            return (
                "No candidate could be compiled: every mesh was refused"
                + (f" (the first: {reason})" if reason else "")
                + ".\nHint: choose a device count or meshes whose sizes divide "
                "the batch and the parameters; the table gives each reason."
            )
        # In bytes below 4 MiB, where two figures in MiB would both read 0.00.
        budget, least = self.budget, min(sizes)
        unit, name = self._unit() if budget >= 4 * 2**20 else (1, "bytes")
        shown = lambda n: f"{n:,}" if unit == 1 else f"{n / unit:.2f}"  # noqa: E731
        return (
            f"No candidate fits the budget of {shown(budget)} {name} per device. "
            f"The smallest needs {shown(least)} {name}, {least - budget:,} bytes "
            "more.\nHint: add devices, shrink the batch, or try more remat "
            "settings or a model axis."
        )

    def _unit(self) -> tuple[int, str]:
        # GiB for real budgets, MiB for the small models of examples and tests.
        return (2**30, "GiB") if self.budget >= 4 * 2**30 else (2**20, "MiB")

    def _header(self) -> list[str]:
        unit, name = self._unit()
        a = self.accelerator
        return [
            f"{self.devices} devices ({self.simulated}); budget "
            f"{self.budget / unit:.2f} {name} per device; estimate for "
            f"{self.accelerator_name} ({a.flops / 1e12:.0f} TFLOP/s, "
            f"{a.link_bytes_per_s / 1e9:.0f} GB/s per device); "
            f"{len(self.candidates)} candidates in {self.seconds:.1f} s",
            "",
            f"| data | fsdp | model | remat | params+opt {name} | args {name} | "
            f"temp {name} | peak {name} | fits | matmul TFLOP | all-gather GB | "
            "all-reduce GB | reduce-scatter GB | other coll. GB | compile s | "
            "estimated ms | |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"
            "---:|---:|---|",
        ]

    def _row(self, c: MeshCandidate) -> str:
        d, f, m = c.mesh
        if c.error is not None:
            return (
                f"| {d} | {f} | {m} | {c.remat} | – | – | – | – | no | "
                f"– | – | – | – | – | – | – | {c.error[:60]} |"
            )
        unit, _ = self._unit()
        coll = dict(c.collective_bytes)
        named = " | ".join(f"{coll.get(k, 0) / 1e9:.2f}" for k in _NAMED)
        other = sum(b for k, b in coll.items() if k not in _NAMED)
        return (
            f"| {d} | {f} | {m} | {c.remat} | {c.state_bytes / unit:.2f} | "
            f"{c.argument_bytes / unit:.2f} | {c.temp_bytes / unit:.2f} | "
            f"{c.device_bytes / unit:.2f} | "
            f"{'yes' if c.device_bytes <= self.budget else 'no'} | "
            f"{c.matmul_flops / 1e12:.1f} | {named} | {other / 1e9:.2f} | "
            f"{c.compile_s:.1f} | {c.estimated_s * 1e3:.1f} | "
            f"{'**chosen**' if c is self.chosen else ''} |"
        )

    def markdown(self) -> str:
        rows = self._header() + [self._row(c) for c in self.candidates]
        return "\n".join(rows + ["", self.message])

    __str__ = markdown
