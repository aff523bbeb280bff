"""Statistics of a carry for [`eqxscan.tap`][] and [`eqxscan.probe`][]."""

from .._internal import (
    max_abs as max_abs,
    nonfinite_count as nonfinite_count,
    rms as rms,
)
