"""Facts about the machine a benchmark ran on, recorded beside its numbers."""

import os
import platform
from pathlib import Path
from typing import Any


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    # Other processes on the machine skew the seconds (not so much the ratios).
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _usable_cores() -> int | None:
    # `taskset` and container CPU sets narrow what XLA's CPU thread pool uses; on
    # a few cores that changes which programs are fastest.
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def describe_machine() -> dict[str, Any]:
    import equinox
    import jax

    device = jax.devices()[0]
    info = {
        "platform": platform.platform(),
        "processor": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "cores_usable": _usable_cores(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "equinox": equinox.__version__,
        "device": f"{device.platform}:{device.device_kind}",
        "load_average_start": load_average(),
    }
    try:
        import flax

        info["flax"] = flax.__version__
    except ImportError:
        pass
    info["summary"] = (
        f"{info['device']} ({info['processor']}, {info['cores_usable']} cores), "
        f"jax {info['jax']}, "
        f"equinox {info['equinox']}"
        + (f", flax {info['flax']}" if "flax" in info else "")
    )
    return info
