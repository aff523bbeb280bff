"""Facts about the machine a benchmark ran on, recorded beside its numbers.

`describe_machine` opens the device: `python -m benchmarks.bench` calls it in a
worker (`_worker.py`), never in its own process."""

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


def device_memory(device: Any) -> int | None:
    """The bytes a JAX device offers (`memory_stats()["bytes_limit"]`; None where
    the backend does not say, as on a CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics raise or return None
        return None
    limit = (stats or {}).get("bytes_limit")
    return None if limit is None else int(limit)


def describe_machine() -> dict[str, Any]:
    """The host, the libraries, and the first device: `"backend"` (`"cpu"`,
    `"gpu"`, `"tpu"`), `"device"` (`"platform:device kind"`), `"device_count"` and
    `"device_memory_bytes"`, with a one-line `"summary"`."""
    import equinox
    import jax

    device = jax.devices()[0]
    info = {
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "device_memory_bytes": device_memory(device),
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
    memory = info["device_memory_bytes"]
    info["summary"] = (
        f"{info['device']}"
        + ("" if memory is None else f" ({memory / 2**30:.1f} GiB)")
        + f" ({info['processor']}, {info['cores_usable']} cores), "
        f"jax {info['jax']}, "
        f"equinox {info['equinox']}"
        + (f", flax {info['flax']}" if "flax" in info else "")
    )
    return info
