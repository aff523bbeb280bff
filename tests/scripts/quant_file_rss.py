"""The resident memory of `quant.quantize_file`, measured as the system sees it
(the process's peak RSS: NumPy's and XLA's buffers and any mapping of the file,
which `tracemalloc` does not see), run in a fresh process by
test_quant_memory.py; also the measurement for docs/quantization.md at larger
sizes:

    python tests/scripts/quant_file_rss.py PATH --dim 1024 --layers 8 --write

`--write` first writes a float StackedMLP(dim, layers) checkpoint to PATH
(8 layers of D = 1024 is 256 MiB of float32). Prints one JSON object, MiB over
the RSS after imports: `first` and `second`, the peaks of two calls of
`quantize_file` (the first's result dropped before the second), `after`, the
RSS held once both results are dropped, and `whole`, the peak of loading the
float model and quantizing it; and the quantized model's and one layer's float
weight's MiB.
Linux only (it reads and resets the peak through /proc/self; `skip` where it
cannot).
"""

import argparse
import gc
import json
import os


os.environ["JAX_PLATFORMS"] = "cpu"

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import eqxscan  # noqa: E402
from eqxscan import quant  # noqa: E402


MIB = 2**20
TARGETS = ["blocks.*.w1", "blocks.*.w2"]


def rss(field: str) -> float:
    """`VmRSS` (now) or `VmHWM` (the peak) of this process, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise LookupError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the RSS now


def write(path: str, like: object) -> None:
    rng = np.random.default_rng(0)

    def draw(s: object) -> object:
        if not isinstance(s, jax.ShapeDtypeStruct):
            return s
        return rng.standard_normal(s.shape, dtype=np.float32)

    eqxscan.save(path, jax.tree.map(draw, like))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    like = eqx.filter_eval_shape(
        eqxscan.StackedMLP, args.dim, args.layers, key=jax.random.key(0)
    )
    if args.write:
        write(args.path, like)

    def streamed():
        return quant.quantize_file(args.path, like, targets=TARGETS)

    def whole():
        return quant.quantize(eqxscan.load_safetensors(args.path, like), TARGETS)

    jax.block_until_ready(jax.numpy.ones(()))  # the backend started
    try:
        reset_peak()
    except OSError as e:  # a system that does not let a process reset it
        print(json.dumps({"skip": f"cannot reset the peak RSS: {e}"}))
        return
    base = rss("VmRSS")
    peaks = []
    for _ in range(2):
        reset_peak()
        q = jax.block_until_ready(streamed())
        peaks.append(rss("VmHWM") - base)
        size = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(q, eqx.is_array)))
        del q
    # JAX releases a host array a JAX array used (on the CPU, without a
    # copy) at its next transfer or garbage collection: the latter, here.
    gc.collect()
    after = rss("VmRSS") - base
    reset_peak()
    jax.block_until_ready(whole())
    result = {
        "first": peaks[0],
        "second": peaks[1],
        "after": after,
        "whole": rss("VmHWM") - base,
        "quantized": size / MIB,
        "layer": args.dim * 4 * args.dim * 4 / MIB,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
