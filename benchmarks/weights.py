"""Saving and loading a stacked model's weights as safetensors, one file against
sharded. Time (median of interleaved repeats, one
process), the peak of the process's resident anonymous memory above what it
held before each call (sampled every millisecond; the loaded model itself
included), and file sizes.

Loading goes into an abstract model (`eqx.filter_eval_shape`), as a restore of
a large model does.

    python benchmarks/weights.py --configs 64x2 512x8 --repeats 3
"""

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

import eqxscan


def _rss() -> int:
    """Resident anonymous memory: what the process allocated. Pages of a file
    it maps (safetensors reads through `mmap`) are the page cache's, and are
    left out."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def measure(fn: Callable[[], object]) -> tuple[float, int]:
    """Seconds, and the peak resident bytes above those held at the start."""
    start, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    thread = threading.Thread(target=sample)
    thread.start()
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(eqx.filter(out, eqx.is_array)) if out is not None else None
    seconds = time.perf_counter() - t0
    done.set()
    thread.join()
    peak[0] = max(peak[0], _rss())
    del out
    return seconds, max(0, peak[0] - start)


def size_of(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return os.path.getsize(path)


def run(dim: int, layers: int, repeats: int, dtype) -> None:
    make = lambda: eqxscan.StackedMLP(dim, layers, key=jax.random.key(0), dtype=dtype)
    model = make()
    like = eqx.filter_eval_shape(make)
    nbytes = sum(v.nbytes for v in eqxscan.to_state_dict(model).values())
    shard = max(nbytes // 4, 1)
    tmp = tempfile.mkdtemp()
    paths = {
        "safetensors": os.path.join(tmp, "model.safetensors"),
        "safetensors, 4 shards": os.path.join(tmp, "sharded"),
    }
    save = {
        "safetensors": lambda: eqxscan.save_safetensors(paths["safetensors"], model),
        "safetensors, 4 shards": lambda: eqxscan.save_safetensors(
            paths["safetensors, 4 shards"], model, max_shard_size=shard
        ),
    }
    load = {
        "safetensors": lambda: eqxscan.load_safetensors(paths["safetensors"], like),
        "safetensors, 4 shards": lambda: eqxscan.load_safetensors(
            paths["safetensors, 4 shards"], like
        ),
    }
    for fn in [*save.values(), *load.values()]:  # warm up: imports, compiles
        fn()
    results: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for _ in range(repeats):
        for name in paths:  # interleaved: every format in every round
            results.setdefault((name, "save"), []).append(measure(save[name]))
            results.setdefault((name, "load"), []).append(measure(load[name]))
    print(
        f"\nD={dim}, L={layers}, {jnp.dtype(dtype).name}: "
        f"{nbytes / 2**20:.2f} MiB of weights"
    )
    print(f"{'format':24} {'save ms':>9} {'load ms':>9} {'save +RSS':>10} "
          f"{'load +RSS':>10} {'file MiB':>9}")  # fmt: skip
    for name, path in paths.items():
        s = results[(name, "save")]
        lo = results[(name, "load")]
        print(
            f"{name:24} {1e3 * statistics.median(t for t, _ in s):9.1f} "
            f"{1e3 * statistics.median(t for t, _ in lo):9.1f} "
            f"{max(m for _, m in s) / 2**20:9.1f}M "
            f"{max(m for _, m in lo) / 2**20:9.1f}M "
            f"{size_of(path) / 2**20:9.3f}"
        )
    shutil.rmtree(tmp)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["64x2", "512x8"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    for config in args.configs:
        dim, layers = map(int, config.split("x"))
        run(dim, layers, args.repeats, jnp.dtype(args.dtype))


if __name__ == "__main__":
    main()
