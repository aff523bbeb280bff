"""Planning a training run for `N` devices ahead of time: every mesh (data x fsdp x
model) and remat setting compiled, XLA's per-device figures, and the fastest that
fits.

Nothing is allocated: the model is built with `eqx.filter_eval_shape` and each
candidate is `jax.jit(...).lower(...).compile()`d with abstract, sharded
arguments. A compile needs `N` devices of some kind; where the current process
has fewer, the candidates are compiled in a child process with `N` simulated CPU
devices (`--xla_force_host_platform_device_count`, which must be set before JAX
starts), so the model builder, the step and the optimiser are then passed by
reference (`"module:attribute"`). The installed JAX has no CPU topology
description (`jax.experimental.topologies`), which would avoid the child.
"""

import dataclasses
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, NamedTuple, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jax.sharding import AxisType, Mesh, NamedSharding

from .._internal import Checkpoint, is_arraylike
from ..remat._budget import checkpoint_label, parse_bytes, with_checkpoint
from ..remat._devices import PEAKS
from ._partition import logical_shardings
from ._shard import (
    batch_shardings,
    gather_layers,
    MIN_SIZE,
    model_shardings,
    opt_state_shardings,
)


#: `(data, fsdp, model)`: the sizes of the three mesh axes.
MeshShape: TypeAlias = tuple[int, int, int]
AXES = ("data", "fsdp", "model")
COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)


class Accelerator(NamedTuple):
    """What the estimate assumes of one device."""

    flops: float
    """Peak dense bfloat16 FLOP/s."""
    link_bytes_per_s: float
    """Bytes per second one device sends to its peers (one direction, all links)."""


#: Datasheet figures: dense bf16 peak (as `eqxscan.remat`'s table) and the
#: device-to-device bandwidth of one chip, one direction (NVLink; TPU ICI).
ACCELERATORS: dict[str, Accelerator] = {
    "B200": Accelerator(PEAKS["B200"].flops, 900e9),
    "H200": Accelerator(PEAKS["H200"].flops, 450e9),
    "H100": Accelerator(PEAKS["H100"].flops, 450e9),
    "A100": Accelerator(PEAKS["A100"].flops, 300e9),
    "TPU v6e": Accelerator(PEAKS["TPU v6 lite"].flops, 448e9),
    "TPU v5p": Accelerator(PEAKS["TPU v5"].flops, 600e9),
    "TPU v5e": Accelerator(PEAKS["TPU v5 lite"].flops, 200e9),
    "TPU v4": Accelerator(PEAKS["TPU v4"].flops, 300e9),
}

# ------------------------------------------------------------------ results


@dataclasses.dataclass(frozen=True)
class MeshCandidate:
    """One compiled (mesh, remat) candidate and XLA's figures per device.

    **Fields:**

    - `mesh`: `(data, fsdp, model)` axis sizes; `checkpoint`: the remat setting
      in words.
    - `state_bytes`: parameters + optimiser state held by each device, from the
      shardings (the largest over devices).
    - `argument_bytes`, `output_bytes`, `alias_bytes`, `temp_bytes`: from
      `memory_analysis()` (parameters and optimiser state are donated, so
      outputs alias them).
    - `flops`, `bytes_accessed`: `cost_analysis()`, which counts a loop body once.
    - `matmul_flops`: FLOPs of the program's dots per step, each loop body
      counted once per iteration (read from the compiled HLO).
    - `collective_bytes`: `(kind, bytes)` pairs: the result bytes of each kind of
      collective per step, loop bodies counted once per iteration.
    - `compile_s`: seconds to lower and compile.
    - `estimated_s`: see [`eqxscan.sharding.MeshPlan`][].
    - `error`: why the candidate could not be compiled (e.g. an axis that does
      not divide), else `None`.
    """

    mesh: MeshShape
    checkpoint: str
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

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "MeshCandidate":
        d = dict(d)
        d["mesh"] = tuple(d["mesh"])
        d["collective_bytes"] = tuple((k, int(b)) for k, b in d["collective_bytes"])
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """Every candidate of an [`eqxscan.sharding.plan`][] call, and the choice.
    `str(plan)` is a Markdown table.

    The estimate of a step's seconds assumes the `accelerator`'s figures: dense
    matmul FLOPs at peak (`matmul_flops / accelerator.flops`) plus every
    collective's bytes sent at the link bandwidth, an all-reduce twice (a ring
    all-reduce is a reduce-scatter and an all-gather), with no overlap of the
    two and nothing else counted. It ranks candidates; it is not a step time.

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
                f"checkpoint={c.checkpoint}"
            )
        smallest = min(
            (c for c in self.candidates if c.error is None),
            key=lambda c: c.device_bytes,
            default=None,
        )
        least = (
            ""
            if smallest is None
            else f" The smallest needs {smallest.device_bytes / 2**30:.2f} GiB."
        )
        return (
            f"No candidate fits the budget of {self.budget / 2**30:.2f} GiB per "
            f"device.{least}\nHint: add devices, shrink the batch, or try more "
            "remat settings or a model axis."
        )

    def markdown(self) -> str:
        gib = 2**30
        # GiB for real budgets, MiB for the small models of examples and tests.
        unit, name = (gib, "GiB") if self.budget >= 4 * gib else (2**20, "MiB")
        a = self.accelerator
        rows = [
            f"{self.devices} devices ({self.simulated}); budget "
            f"{self.budget / unit:.2f} {name} per device; estimate for "
            f"{self.accelerator_name} ({a.flops / 1e12:.0f} TFLOP/s, "
            f"{a.link_bytes_per_s / 1e9:.0f} GB/s per device); "
            f"{len(self.candidates)} candidates in {self.seconds:.1f} s",
            "",
            f"| data | fsdp | model | checkpoint | params+opt {name} | args {name} | "
            f"temp {name} | peak {name} | fits | matmul TFLOP | all-gather GB | "
            "all-reduce GB | reduce-scatter GB | other coll. GB | compile s | "
            "estimated ms | |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"
            "---:|---:|---|",
        ]
        for c in self.candidates:
            d, f, m = c.mesh
            if c.error is not None:
                rows.append(
                    f"| {d} | {f} | {m} | {c.checkpoint} | – | – | – | – | no | "
                    f"– | – | – | – | – | – | – | {c.error[:60]} |"
                )
                continue
            coll = dict(c.collective_bytes)
            other = sum(
                b
                for k, b in coll.items()
                if k not in ("all-gather", "all-reduce", "reduce-scatter")
            )
            rows.append(
                f"| {d} | {f} | {m} | {c.checkpoint} | {c.state_bytes / unit:.2f} | "
                f"{c.argument_bytes / unit:.2f} | {c.temp_bytes / unit:.2f} | "
                f"{c.device_bytes / unit:.2f} | "
                f"{'yes' if c.device_bytes <= self.budget else 'no'} | "
                f"{c.matmul_flops / 1e12:.1f} | "
                f"{coll.get('all-gather', 0) / 1e9:.2f} | "
                f"{coll.get('all-reduce', 0) / 1e9:.2f} | "
                f"{coll.get('reduce-scatter', 0) / 1e9:.2f} | {other / 1e9:.2f} | "
                f"{c.compile_s:.1f} | {c.estimated_s * 1e3:.1f} | "
                f"{'**chosen**' if c is self.chosen else ''} |"
            )
        rows += ["", self.message]
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.markdown()


# ------------------------------------------------------------------ the HLO


_DTYPE_BYTES = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \((.*)\) -> .* \{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply)=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(
                int(d) for d in dims.split(",") if d
            )
    return total


def _dims(text: str) -> list[int]:
    m = _ARRAY.search(text)
    return [] if m is None else [int(d) for d in m.group(2).split(",") if d]


def hlo_costs(text: str) -> tuple[dict[str, int], float]:
    """Collective result bytes by kind and matmul FLOPs of one run of the compiled
    HLO module `text`, each loop body counted once per iteration (XLA's own cost
    analysis counts it once)."""
    comps: dict[str, list[str]] = {}
    entry = None
    current: list[str] | None = None
    params: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            name = header.group(1)
            current = comps.setdefault(name, [])
            if line.startswith("ENTRY"):
                entry = name
            # Parameter shapes, for dots whose operands are parameters.
            params[name] = dict(
                (p.split(":")[0].strip(), p.split(":", 1)[1])
                for p in re.split(r",\s*(?=[\w.\-]+: )", header.group(2))
                if ":" in p
            )
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    if entry is None:
        return {}, 0.0
    # How many times each computation runs per step: a while body (and
    # condition) its trip count times per run of the caller.
    times: dict[str, int] = {entry: 1}
    order = [entry]
    for name in order:
        for line in comps.get(name, ()):
            trip = _TRIP.search(line)
            is_while = " while(" in line
            for kind, callee in _CALLED.findall(line):
                if kind == "to_apply" or callee not in comps:
                    continue
                n = times[name] * (int(trip.group(1)) if is_while and trip else 1)
                if callee not in times:
                    order.append(callee)
                times[callee] = times.get(callee, 0) + n if callee in times else n
    collective: dict[str, int] = {}
    flops = 0.0
    for name in order:
        n = times[name]
        shapes = dict(params.get(name, {}))
        for line in comps[name]:
            m = _INSTR.match(line)
            if not m:
                continue
            var, result, op, rest = m.groups()
            shapes[var] = result
            base = op.removesuffix("-start")
            if base in COLLECTIVES and not op.endswith("-done"):
                size = _shape_bytes(result)
                if op.endswith("-start") and base in (
                    "all-gather",
                    "collective-permute",
                ):
                    size //= 2  # an async start's result holds its operand too
                collective[base] = collective.get(base, 0) + n * size
            elif op == "dot":
                lhs = re.match(r"\s*%?([\w.\-]+)", rest)
                contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
                if lhs is None or contract is None:
                    continue
                lhs_dims = _dims(shapes.get(lhs.group(1), ""))
                k = math.prod(
                    lhs_dims[int(i)]
                    for i in contract.group(1).split(",")
                    if i and int(i) < len(lhs_dims)
                )
                flops += n * 2.0 * math.prod(_dims(result)) * k
    return collective, flops


# ------------------------------------------------------------------ references


def _resolve(ref: str, what: str) -> object:
    module, _, attr = ref.partition(":")
    try:
        obj: object = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(
            f"plan: cannot import {what} {ref!r} ({type(e).__name__}: {e}).\nHint: "
            "give it as 'package.module:function', importable with the same "
            "PYTHONPATH by a fresh Python process."
        ) from None
    return obj


def _reference(obj: object, what: str) -> str:
    if isinstance(obj, str):
        if ":" not in obj:
            raise ValueError(
                f"plan: {what} {obj!r} is not a reference.\nHint: write it as "
                "'package.module:function'."
            )
        _resolve(obj, what)
        return obj
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None)
    ref = f"{module}:{name}"
    ok = module not in (None, "__main__") and name and "<" not in name
    if ok:
        try:
            ok = _resolve(ref, what) is obj
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(
            f"plan: {what} {obj!r} must be importable by reference, since this "
            "process lacks the devices and the candidates are compiled in a fresh "
            "process.\nHint: define it at the top level of an importable module "
            "(not __main__, not a lambda or closure) or pass 'module:function'."
        )
    return ref


def _encode_batch(batch: object) -> object:
    if isinstance(batch, jax.ShapeDtypeStruct):
        return {"shape": list(batch.shape), "dtype": jnp.dtype(batch.dtype).name}
    if isinstance(batch, (tuple, list)):
        return {"seq": [_encode_batch(b) for b in batch], "tuple": True}
    if isinstance(batch, dict):
        return {"map": {str(k): _encode_batch(v) for k, v in batch.items()}}
    raise TypeError(
        f"plan: batch must be jax.ShapeDtypeStructs in tuples, lists or dicts, got "
        f"{type(batch).__name__}.\nHint: jax.ShapeDtypeStruct((B, T), jnp.int32)."
    )


def _decode_batch(d: object) -> object:
    if "shape" in d:
        return jax.ShapeDtypeStruct(tuple(d["shape"]), jnp.dtype(d["dtype"]))
    if "seq" in d:
        return tuple(_decode_batch(b) for b in d["seq"])
    return {k: _decode_batch(v) for k, v in d["map"].items()}


def _encode_checkpoint(c: Checkpoint) -> object:
    if isinstance(c, (bool, str)):
        return c
    for name, value in vars(jax.checkpoint_policies).items():
        if value is c:
            return {"policy": name}
    raise ValueError(
        f"plan: remat setting {c!r} cannot be passed to a fresh process.\nHint: "
        "use True, False, 'auto', 'nested', 'offload' or a jax.checkpoint_policies "
        "policy."
    )


def _decode_checkpoint(c: object) -> Checkpoint:
    return getattr(jax.checkpoint_policies, c["policy"]) if isinstance(c, dict) else c


# ------------------------------------------------------------------ candidates


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shapes(devices: int, model: Sequence[int] = (1,)) -> list[MeshShape]:
    """Every `(data, fsdp, model)` with product `devices`, `model` from `model`."""
    out = []
    for m in model:
        if devices % m:
            raise ValueError(
                f"plan: a model axis of {m} does not divide {devices} devices.\n"
                f"Hint: choose model sizes among {_divisors(devices)}."
            )
        for d in _divisors(devices // m):
            out.append((d, devices // m // d, m))
    return out


@dataclasses.dataclass(frozen=True)
class Job:
    """What every candidate of a plan compiles: the model (`make_model(key,
    **model_kwargs)`), the train step `step(model, opt_state, batch)`, the
    optimiser (or `None`), an example batch, and how the parameters are sharded
    (logical `axes` and `rules`, or FSDP by size when `axes` is `None`; arrays
    under `min_size` elements replicated)."""

    make_model: Callable
    model_kwargs: Mapping[str, object]
    step: Callable
    optimizer: object
    batch: object
    axes: Mapping[str, object] | None
    rules: Mapping[str, object] | None
    min_size: int


def _abstract(
    job: Job, mesh: Mesh, checkpoint: Checkpoint
) -> tuple[tuple[object, object], tuple[object, object], object]:
    """The model (gathering one layer per scan step) and optimiser state, as
    `ShapeDtypeStruct`s, with their shardings; and the model's static part."""
    key = jax.random.key(0)
    shape = eqx.filter_eval_shape(lambda k: job.make_model(k, **job.model_kwargs), key)
    if job.axes is None:
        specs = model_shardings(shape, mesh, fsdp_axis="fsdp", min_size=job.min_size)
        keep: tuple[str, ...] = ()
    else:
        specs = logical_shardings(
            shape,
            mesh,
            job.axes,
            job.rules or {},
            fsdp_axis="fsdp",
            min_size=job.min_size,
        )
        keep = ("model",)

    def build(k: jax.Array) -> object:
        model = with_checkpoint(job.make_model(k, **job.model_kwargs), checkpoint)
        return gather_layers(model, mesh, specs if keep else None, keep=keep)

    model = eqx.filter_eval_shape(build, key)
    params, static = eqx.partition(model, is_arraylike)
    param_specs = jtu.tree_unflatten(
        jtu.tree_structure(params),
        jtu.tree_leaves(eqx.filter(specs, lambda s: isinstance(s, NamedSharding))),
    )
    optimizer = job.optimizer
    opt_state = None if optimizer is None else jax.eval_shape(optimizer.init, params)
    opt_specs = (
        None
        if optimizer is None
        else opt_state_shardings(
            opt_state, model, mesh, fsdp_axis="fsdp", param_shardings=param_specs
        )
    )
    return (params, param_specs), (opt_state, opt_specs), static


def _per_device_bytes(tree: object, specs: object) -> int:
    total = 0
    for leaf, spec in zip(jtu.tree_leaves(tree), jtu.tree_leaves(specs), strict=True):
        shard = spec.shard_shape(tuple(leaf.shape))
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


def program(
    job: Job, mesh: Mesh, checkpoint: Checkpoint
) -> tuple[object, tuple[object, object], tuple[object, object], object, object]:
    """The jitted step of one candidate, `(params, shardings)`, `(opt_state,
    shardings)` as `ShapeDtypeStruct`s, the batch's shardings and the model's
    static part (`step` then takes and returns the model's arrays only)."""
    (params, p_specs), (opt_state, o_specs), static = _abstract(job, mesh, checkpoint)
    b_specs = batch_shardings(job.batch, mesh, batch_axes=("data", "fsdp"))

    def train(params: object, opt_state: object, batch: object) -> object:
        out = job.step(eqx.combine(params, static), opt_state, batch)
        model, opt_state, *rest = out
        return eqx.filter(model, eqx.is_array), opt_state, tuple(rest)

    jitted = jax.jit(
        train,
        in_shardings=(p_specs, o_specs, b_specs),
        out_shardings=(p_specs, o_specs, None),
        donate_argnums=(0, 1),
    )
    return jitted, (params, p_specs), (opt_state, o_specs), b_specs, static


def _compile_one(
    job: Job, mesh: Mesh, checkpoint: Checkpoint, accelerator: Accelerator
) -> MeshCandidate:
    shape = tuple(mesh.shape[a] for a in AXES)
    label = checkpoint_label(checkpoint)
    start = time.perf_counter()
    try:
        jitted, (params, p_specs), (opt_state, o_specs), _, _ = program(
            job, mesh, checkpoint
        )
    except ValueError as e:
        return MeshCandidate(shape, label, error=str(e).splitlines()[0])
    compiled = jitted.lower(params, opt_state, job.batch).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    collective, matmul = hlo_costs(compiled.as_text())
    state = _per_device_bytes(params, p_specs)
    if opt_state is not None:
        state += _per_device_bytes(opt_state, o_specs)
    sent = sum(b * (2 if k == "all-reduce" else 1) for k, b in collective.items())
    return MeshCandidate(
        mesh=shape,
        checkpoint=label,
        state_bytes=state,
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        matmul_flops=matmul,
        collective_bytes=tuple(sorted(collective.items())),
        compile_s=seconds,
        estimated_s=matmul / accelerator.flops + sent / accelerator.link_bytes_per_s,
    )


def make_plan_mesh(shape: MeshShape, devices: Sequence[jax.Device]) -> Mesh:
    """The `("data", "fsdp", "model")` mesh of a candidate, over `devices`."""
    return jax.make_mesh(
        shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=list(devices)
    )


def _run_all(spec: dict, report: Callable[[int, int, str], None]) -> list[dict]:
    # Compile every candidate in this process; `spec` as built by `plan`.
    make_model = spec["make_model"]
    step = spec["step"]
    optimizer = spec["optimizer"]
    if isinstance(make_model, str):
        make_model = _resolve(make_model, "make_model")
    if isinstance(step, str):
        step = _resolve(step, "step")
    if isinstance(optimizer, str):
        optimizer = _resolve(optimizer, "optimizer")
    if optimizer is not None and not isinstance(
        optimizer, optax.GradientTransformation
    ):
        optimizer = optimizer()
    batch = spec["batch"]
    if spec.get("encoded"):
        batch = _decode_batch(batch)
    devices = jax.devices()[: spec["devices"]]
    accelerator = Accelerator(*spec["accelerator"])
    axes = spec["axes"]
    if axes is not None:
        axes = {k: tuple(v) for k, v in axes.items()}
    settings = [
        (tuple(m), _decode_checkpoint(c)) for m in spec["meshes"] for c in spec["remat"]
    ]
    job = Job(
        make_model,
        spec["model_kwargs"],
        step,
        optimizer,
        batch,
        axes,
        spec["rules"],
        spec["min_size"],
    )
    rows = []
    for i, (shape, checkpoint) in enumerate(settings):
        report(i, len(settings), f"{shape} {checkpoint_label(checkpoint)}")
        row = _compile_one(job, make_plan_mesh(shape, devices), checkpoint, accelerator)
        rows.append(row.to_json())
    report(len(settings), len(settings), "done")
    return rows


_PROGRESS = "eqxscan-plan-progress "


def _child(spec: dict, report: Callable[[int, int, str], None]) -> list[dict]:
    # Run the candidates in a fresh process with `devices` CPU devices.
    env = dict(os.environ)
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={spec['devices']}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.getcwd(), here, env.get("PYTHONPATH", "")) if p
    )
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        tail: list[str] = []
        with subprocess.Popen(
            [sys.executable, "-m", __name__, spec_path, out_path],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        ) as proc:
            assert proc.stderr is not None
            for line in proc.stderr:
                if line.startswith(_PROGRESS):
                    i, n, what = line[len(_PROGRESS) :].rstrip("\n").split(" ", 2)
                    report(int(i), int(n), what)
                else:
                    tail = (tail + [line])[-40:]
        if proc.returncode != 0:
            raise RuntimeError(
                f"plan: the process compiling the candidates on {spec['devices']} "
                f"CPU devices exited with status {proc.returncode}:\n" + "".join(tail)
            )
        with open(out_path) as f:
            return json.load(f)


def _quiet(i: int, n: int, what: str) -> None:
    pass


def plan(
    make_model: Callable[..., object] | str,
    step: Callable[..., object] | str,
    *,
    batch: object,
    budget: int | str,
    optimizer: optax.GradientTransformation | Callable[[], object] | str | None = None,
    devices: int | None = None,
    meshes: Sequence[MeshShape] | None = None,
    model_axis: Sequence[int] = (1,),
    remat: Sequence[Checkpoint] = (False, True),
    axes: Mapping[str, tuple[str | None, ...]] | None = None,
    rules: Mapping[str, str | None] | None = None,
    model_kwargs: Mapping[str, object] | None = None,
    min_size: int = MIN_SIZE,
    accelerator: str = "H100",
    peak_flops: float | None = None,
    link_bytes_per_s: float | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    simulate: Literal["auto", "always"] = "auto",
) -> MeshPlan:
    """Compile a training step ahead of time for every mesh and remat setting on
    `N` devices, and choose the fastest that fits a per-device memory budget.

    The model is never allocated: `make_model(key, **model_kwargs)` runs under
    `eqx.filter_eval_shape`. For each mesh `(data, fsdp, model)` and each remat
    setting, the parameters are placed by [`eqxscan.sharding.model_shardings`][]
    over `"fsdp"` (or, with `axes`, by [`eqxscan.sharding.logical_shardings`][],
    e.g. MLP and head axes over `"model"`), every `Stacked` gathers one layer per
    scan step ([`eqxscan.sharding.gather_layers`][], keeping `"model"` split),
    the optimiser state follows its parameters, the batch is split over `"data"`
    and `"fsdp"`, and `step` is `jax.jit(...).lower(...).compile()`d with the
    parameters and optimiser state donated. A candidate whose axis sizes do not
    divide the arrays is listed with the reason, not compiled.

    The compile needs `N` devices. If this process has fewer, the candidates are
    compiled in a fresh process with `N` simulated CPU devices; `make_model`,
    `step` and `optimizer` must then be importable (`"module:attribute"`
    strings, or top-level functions of an importable module, which are passed
    by that name). CPU compiles give the program's per-device figures for a
    target whose memory layout matches: sizes of arguments and outputs exactly,
    temporaries as XLA's CPU backend schedules them.

    **Arguments:**

    - `make_model`: `make_model(key, **model_kwargs) -> model`.
    - `step`: `step(model, opt_state, batch) -> (model, opt_state, *rest)`, one
      training step returning the updated model and optimiser state first.
    - `batch`: the batch as `jax.ShapeDtypeStruct`s (in tuples, lists or dicts),
      axis 0 the global batch.
    - `budget`: bytes per device, an int or a string such as `"80GB"`.
    - `optimizer`: an `optax.GradientTransformation`, a function returning one,
      or a reference to either; `None` gives `opt_state=None`.
    - `devices`: `N`; with `meshes` it may be left out.
    - `meshes`: the `(data, fsdp, model)` shapes to try; default every
      factorisation of `N` with the model axis from `model_axis`.
    - `model_axis`: model-axis sizes tried by default (more than 1 needs `axes`).
    - `remat`: the `checkpoint=` settings to try on every scan.
    - `axes`, `rules`: logical axis names and rules, as for `logical_shardings`
      (mesh axes `"data"`, `"fsdp"`, `"model"`).
    - `model_kwargs`: JSON-compatible keyword arguments of `make_model`.
    - `min_size`: leaves with fewer elements are replicated.
    - `accelerator`: a key of `ACCELERATORS` (`"H100"`, `"TPU v5p"`, ...) whose
      figures the estimate assumes; `peak_flops`, `link_bytes_per_s` override
      them.
    - `progress`: called as `progress(done, total, what)` before each compile.
    - `simulate`: `"always"` compiles in a fresh process even if this one has
      the devices.

    **Returns:**

    An [`eqxscan.sharding.MeshPlan`][]. If nothing fits, `chosen` is `None` and
    `plan.message` says by how much the smallest misses.
    """
    limit = parse_bytes(budget)
    if accelerator not in ACCELERATORS:
        raise ValueError(
            f"plan: unknown accelerator {accelerator!r}.\nHint: one of "
            f"{sorted(ACCELERATORS)}, with peak_flops= and link_bytes_per_s= to "
            "override its figures."
        )
    base = ACCELERATORS[accelerator]
    acc = Accelerator(
        base.flops if peak_flops is None else float(peak_flops),
        base.link_bytes_per_s if link_bytes_per_s is None else float(link_bytes_per_s),
    )
    if meshes is None:
        if devices is None:
            raise ValueError(
                "plan: give devices=N or meshes=[(data, fsdp, model), ...].\nHint: "
                "devices=8 tries every factorisation of 8."
            )
        if any(m > 1 for m in model_axis) and axes is None:
            raise ValueError(
                "plan: a model axis larger than 1 needs axes= and rules= naming "
                "which parameter axes it splits.\nHint: see "
                "eqxscan.sharding.logical_shardings."
            )
        shapes = mesh_shapes(devices, model_axis)
    else:
        shapes = [tuple(int(s) for s in m) for m in meshes]
        sizes = {math.prod(m) for m in shapes}
        if any(len(m) != 3 or min(m) < 1 for m in shapes) or len(sizes) != 1:
            raise ValueError(
                f"plan: meshes must be (data, fsdp, model) triples of positive sizes "
                f"with one product, got {list(meshes)}.\nHint: e.g. [(8, 1, 1), "
                "(1, 8, 1)] for 8 devices."
            )
        n = sizes.pop()
        if any(m[2] > 1 for m in shapes) and axes is None:
            raise ValueError(
                "plan: a model axis larger than 1 needs axes= and rules= naming "
                "which parameter axes it splits.\nHint: see "
                "eqxscan.sharding.logical_shardings."
            )
        if devices is not None and devices != n:
            raise ValueError(
                f"plan: the meshes need {n} devices, but devices={devices}.\nHint: "
                "leave devices out when giving meshes."
            )
        devices = n
    if not remat:
        raise ValueError("plan: remat is empty.\nHint: e.g. remat=(False, True).")
    report = progress or _quiet
    start = time.perf_counter()
    local = len(jax.devices()) >= devices and simulate == "auto"
    spec = {
        "devices": devices,
        "meshes": [list(m) for m in shapes],
        "remat": [_encode_checkpoint(c) for c in remat],
        "axes": None if axes is None else {k: list(v) for k, v in axes.items()},
        "rules": None if rules is None else dict(rules),
        "model_kwargs": dict(model_kwargs or {}),
        "min_size": min_size,
        "accelerator": list(acc),
    }
    if local:
        spec.update(make_model=make_model, step=step, optimizer=optimizer, batch=batch)
        rows = _run_all(spec, report)
        simulated = f"this process's {jax.devices()[0].platform} devices"
    else:
        spec.update(
            make_model=_reference(make_model, "make_model"),
            step=_reference(step, "step"),
            optimizer=(
                None
                if optimizer is None
                else _not_importable()
                if isinstance(optimizer, optax.GradientTransformation)
                else _reference(optimizer, "optimizer")
            ),
            batch=_encode_batch(batch),
            encoded=True,
        )
        rows = _child(spec, report)
        simulated = "simulated CPU devices in a fresh process"
    candidates = tuple(MeshCandidate.from_json(r) for r in rows)
    fitting = [c for c in candidates if c.error is None and c.device_bytes <= limit]
    chosen = min(fitting, key=lambda c: c.estimated_s, default=None)
    return MeshPlan(
        devices=devices,
        budget=limit,
        candidates=candidates,
        chosen=chosen,
        accelerator_name=accelerator,
        accelerator=acc,
        simulated=simulated,
        seconds=time.perf_counter() - start,
    )


def _not_importable() -> str:
    raise ValueError(
        "plan: an optax.GradientTransformation object cannot be passed to the "
        "fresh process that compiles the candidates.\nHint: pass a top-level "
        "function returning it, or 'module:function'."
    )


def _main(argv: Sequence[str]) -> None:
    spec_path, out_path = argv

    def report(i: int, n: int, what: str) -> None:
        print(f"{_PROGRESS}{i} {n} {what}", file=sys.stderr, flush=True)

    with open(spec_path) as f:
        spec = json.load(f)
    rows = _run_all(spec, report)
    with open(out_path, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    _main(sys.argv[1:])
