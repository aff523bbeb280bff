"""What XLA compiles for a TPU v5e chip, without one: a deviceless compile
(`jax.experimental.topologies`) of the decode steps of `benchmarks/quantized.py`
(every format, scanned and unrolled) and of a StackedMLP train step
(`value_and_grad`, float32 and bfloat16), printing XLA's temporaries
(`memory_analysis().temp_size_in_bytes`) and every instruction that converts
or copies a whole stacked leaf (all layers of a weight). These are XLA's
compiled memory figures for the target, not timings.

Needs `libtpu` (no TPU): `pip install "jax[tpu]==<your jax version>"`.

    python -m benchmarks.tpu_compile                  # B = 8, L = 16, D = 2048
    python -m benchmarks.tpu_compile --dim 512 --tiny # smaller, faster
    python -m benchmarks.tpu_compile --transformer    # the bench's Transformer

`--transformer` compiles `python -m benchmarks.bench --model transformer`'s train
step (D=2048, batch 8 x seq 1024, bfloat16, L=4) scanned with the matmul-saving
policy (`remat="auto"`'s choice on a TPU), scanned with `dots_saveable` and as
the unrolled loop, and prints every copy XLA makes outside a
fusion, by the loop body it runs in (once a layer) or the entry (once a step).
"""

import argparse
import importlib.util
import os
import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqxscan
from benchmarks.quantized import FORMATS, model_of, STEPS


_TPU_ENV = {
    # A compile-only TPU client on a machine without a TPU or its metadata server.
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_WORKER_ID": "0",
}
_COPYING_OPS = ("convert", "copy", "copy-start", "fusion")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.-]+) \(")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(")


def tpu_target():
    """A sharding on one chip of a TPU v5e topology (no device needed), or
    exit with the pip command when `libtpu` is missing."""
    if importlib.util.find_spec("libtpu") is None:
        sys.exit(
            "benchmarks.tpu_compile needs libtpu to compile for a TPU (no TPU "
            f'is needed): pip install "jax[tpu]=={jax.__version__}"'
        )
    for name, value in _TPU_ENV.items():
        os.environ.setdefault(name, value)
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    topology = topologies.get_topology_desc(
        platform="tpu",
        topology_name="v5e:1x1",
        chips_per_host_bounds=(1, 1, 1),
        num_slices=1,
        wrap=(False, False, False),
    )
    return NamedSharding(Mesh(topology.devices, ("x",)), PartitionSpec())


def stack_copies(hlo: str, params) -> list[str]:
    """The instructions of `hlo` (outside fusions, whose insides read tiles of
    their operands) that write a whole stacked leaf of `params` in another
    dtype (a convert, or a fusion holding one) or copy it."""
    stacks = {
        (tuple(a.shape), _hlo_dtype(jnp.dtype(a.dtype).name))
        for a in jax.tree.leaves(params)
        if a.ndim >= 3
    }
    shapes = {shape for shape, _ in stacks}
    fused = set(re.findall(r" fusion\(.*?calls=%([\w.-]+)", hlo))
    found, inside = [], ""
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            inside = header.group(1)
        match = _INSTRUCTION.match(line)
        if not match or inside in fused:
            continue
        name, dtype, dims, op = match.groups()
        shape = tuple(int(d) for d in dims.split(",") if d)
        if shape not in shapes or op not in _COPYING_OPS:
            continue
        if op == "fusion" and (shape, dtype) in stacks:
            continue  # writes a result of that shape (a gradient), not a copy
        found.append(f"{op} -> {dtype}[{dims}] ({name})")
    return found


def _hlo_dtype(name: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "int8": "s8", "uint8": "u8"}.get(
        name, name
    )


def _is_shape(leaf: object) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)


def compiled_facts(fn, params, x, target) -> dict:
    """Compile `fn(params, x)` for `target` from shapes alone."""
    place = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=target)  # noqa: E731
    lowered = jax.jit(fn).lower(jax.tree.map(place, params), place(x))
    compiled = lowered.compile()
    return {
        # A TPU holds `int4` two a byte (NumPy's itemsize says one).
        "weights": sum(
            a.size * a.dtype.itemsize // (2 if a.dtype == jnp.int4 else 1)
            for a in jax.tree.leaves(params)
        ),
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "copies": stack_copies(compiled.as_text(), params),
    }


def decode_step(fmt: str, step: str, batch: int, layers: int, dim: int, target):
    """The decode step of `benchmarks/quantized.py`, compiled for `target`."""
    model = eqx.filter_eval_shape(model_of, fmt, dim, layers)
    # int4 as a TPU holds it by default (this host's "auto" would pack it).
    model = eqxscan.quant.with_int4_storage(model, "native")
    options = STEPS[step]
    model = eqx.tree_at(lambda m: m.blocks, model, model.blocks.with_options(**options))
    params, static = eqx.partition(model, _is_shape)
    x = jax.ShapeDtypeStruct((batch, dim), model.dtype)
    return compiled_facts(lambda p, x: eqx.combine(p, static)(x), params, x, target)


def train_step(dtype, remat, batch: int, layers: int, dim: int, target):
    """`value_and_grad` of a StackedMLP's mean squared output, scanned."""
    import eqxscan

    model = eqx.filter_eval_shape(
        lambda: eqxscan.StackedMLP(dim, layers, key=jax.random.key(0), dtype=dtype)
    )
    model = eqx.tree_at(
        lambda m: m.blocks, model, model.blocks.with_options(mode="scan", remat=remat)
    )
    params, static = eqx.partition(model, _is_shape)

    def loss(p, x):
        out = eqx.combine(p, static)(x)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    x = jax.ShapeDtypeStruct((batch, dim), dtype)
    return compiled_facts(jax.value_and_grad(loss), params, x, target)


def loop_copies(hlo: str) -> dict[str, list[tuple[str, int]]]:
    """`{"body" or "entry": [(shape, bytes), ...]}`: the `copy` instructions of
    `hlo` outside fusions, in a while loop's body (run once an iteration) or in
    the entry computation."""
    bodies = set(re.findall(r" while\(.*?body=%([\w.-]+)", hlo))
    found: dict[str, list[tuple[str, int]]] = {"body": [], "entry": []}
    inside, entry = "", False
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            inside, entry = header.group(1), line.startswith("ENTRY")
        match = _INSTRUCTION.match(line)
        if not match or match.group(4) != "copy" or not (entry or inside in bodies):
            continue
        _, dtype, dims, _ = match.groups()
        size = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        width = {"bf16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1}
        found["entry" if entry else "body"].append(
            (f"{dtype}[{dims}]", size * width.get(dtype, 4))
        )
    return found


def transformer_copies(impl: str, layers: int, target) -> tuple[int, dict]:
    """XLA's temp bytes and `loop_copies` of the bench's Transformer train step
    (`impl`: a name of `benchmarks.bench`'s registry, or `"eqxscan-tpu"`: the
    scan with what `remat="auto"` picks on a TPU, which this CPU host's
    `"auto"` would not), compiled for `target`."""
    from benchmarks.bench._measure import registry
    from benchmarks.bench._transformer import _eqxscan

    impls, make = registry("transformer")
    with jax.default_device(jax.devices("cpu")[0]):  # values on the host: no TPU
        module, x, y = make(layers, 2048, 8, 1024, "bfloat16")
    if impl == "eqxscan-tpu":
        built = _eqxscan(remat=eqxscan.remat.matmul_policy, unroll=1)(module)
    else:
        built = impls[impl].build(module)
    place = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=target)  # noqa: E731
    params = jax.tree.map(place, built.params)
    step = jax.jit(jax.value_and_grad(built.loss))
    compiled = step.lower(params, place(x), place(y)).compile()
    return compiled.memory_analysis().temp_size_in_bytes, loop_copies(
        compiled.as_text()
    )


def _row(label: str, facts: dict) -> str:
    mib = 2.0**20
    copies = "; ".join(facts["copies"]) or "none"
    return (
        f"{label:<28}{facts['weights'] / mib:>12.1f}{facts['temp'] / mib:>10.1f}"
        f"  {copies}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS))
    parser.add_argument("--tiny", action="store_true", help="float32 only, no train")
    parser.add_argument(
        "--transformer", action="store_true", help="instead: the Transformer's copies"
    )
    args = parser.parse_args()
    target = tpu_target()
    if args.transformer:
        mib = 2.0**20
        for impl in ("eqxscan-tpu", "eqxscan-dots", "eqxscan-loop"):
            temp, copies = transformer_copies(impl, 4, target)
            print(f"{impl}, L=4: temp {temp / mib:.1f} MiB")
            for where, found in copies.items():
                total = sum(n for _, n in found) / mib
                shapes = ", ".join(f"{shape} {n / mib:.1f}" for shape, n in found)
                print(f"  {where}: {len(found)} copies, {total:.1f} MiB: {shapes}")
        return
    size = (args.batch, args.layers, args.dim)
    print(
        f"Deviceless compile for TPU v5e (jax {jax.__version__}), B={size[0]} "
        f"L={size[1]} D={size[2]}: XLA's compiled memory, not a timing"
    )
    print(
        f"{'step':<28}{'weights MiB':>12}{'temp MiB':>10}  whole-stack converts/copies"
    )
    for fmt in ["float32"] if args.tiny else args.formats:
        for step in STEPS:
            print(_row(f"decode {fmt} {step}", decode_step(fmt, step, *size, target)))
    if args.tiny:
        return
    for dtype in (jnp.float32, jnp.bfloat16):
        for remat in ("auto", False, True):
            label = f"train {jnp.dtype(dtype).name} remat={remat}"
            print(_row(label, train_step(dtype, remat, *size, target)))


if __name__ == "__main__":
    main()
