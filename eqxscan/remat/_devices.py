"""Peak rates of common accelerators, for cost estimates and utilisation figures."""

from typing import NamedTuple


class Peak(NamedTuple):
    """A device's dense bfloat16 matmul rate and its memory bandwidth."""

    flops: float
    """Peak dense bfloat16 FLOP/s (no structured sparsity)."""
    bytes_per_s: float
    """Peak memory (HBM or DRAM) bandwidth in bytes/s."""


#: Vendor datasheet figures, matched against `jax.Device.device_kind` by substring,
#: most specific first (so "H100 PCIe" is found before "H100").
PEAKS: dict[str, Peak] = {
    "B200": Peak(2.25e15, 8.0e12),
    "H200": Peak(989e12, 4.8e12),
    "H100 PCIe": Peak(756e12, 2.0e12),
    "H100": Peak(989e12, 3.35e12),
    "A100": Peak(312e12, 2.0e12),
    "L40S": Peak(362e12, 0.864e12),
    "L4": Peak(121e12, 0.3e12),
    "TPU v6 lite": Peak(918e12, 1.64e12),
    "TPU v5 lite": Peak(197e12, 0.819e12),
    "TPU v5": Peak(459e12, 2.76e12),
    "TPU v4": Peak(275e12, 1.2e12),
}

#: Ranks programs on a CPU or an unknown device, where only the ratio matters.
#: XLA's "bytes accessed" counts operands that mostly stay in cache on a CPU; at 2
#: FLOPs per byte the estimate ranks both `benchmarks/remat_budget.py` models'
#: candidates as measured (at 10 it preferred full remat, 1.04-1.13x slower).
FALLBACK = Peak(1e11, 5e10)


def peak_of(device_kind: str) -> Peak | None:
    """The table's entry for a `jax.Device.device_kind`, or `None` if unknown."""
    for name, peak in PEAKS.items():
        if name.lower() in device_kind.lower():
            return peak
    return None
