"""The candidates of a plan and their compiles: every `(data, fsdp, model)` mesh
of `N` devices, the job each compiles (`Job`: model, step, optimiser, batch and
how the parameters are sharded), the jitted step of one candidate (`program`),
and XLA's figures of every candidate compiled in this process."""

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import AxisType, Mesh, NamedSharding
from jaxtyping import PyTree

from .._internal import check_size, Device, is_arraylike, Remat, remat_label
from ..remat import with_remat
from ..sharding import (
    batch_shardings,
    gather_layers,
    logical_shardings,
    model_shardings,
    opt_state_shardings,
)
from ._hlo import hlo_costs
from ._report import Accelerator, MeshCandidate, MeshShape


if TYPE_CHECKING:
    import optax


AXES = ("data", "fsdp", "model")
#: Logical axis names of one leaf, as for `eqxscan.sharding.logical_shardings`.
Names: TypeAlias = tuple[str | None, ...]
#: As `sharding.logical_spec` takes them: a dict or `(name, axes)` pairs.
Rules: TypeAlias = (
    Mapping[str, str | Sequence[str] | None]
    | Sequence[tuple[str, str | Sequence[str] | None]]
)
#: `progress(done, total, what)`, called before each compile.
Progress = Callable[[int, int, str], None]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shapes(devices: int, model: Sequence[int] = (1,)) -> list[MeshShape]:
    """Every `(data, fsdp, model)` with product `devices`, `model` from `model`."""
    for m in model:
        if check_size("model_axis", m) and devices % m:
            raise ValueError(
                f"plan: a model axis of {m} does not divide {devices} devices.\n"
                f"Hint: choose model sizes among {_divisors(devices)}."
            )
    return [(d, devices // m // d, m) for m in model for d in _divisors(devices // m)]


def make_plan_mesh(shape: MeshShape, devices: Sequence[Device]) -> Mesh:
    """The `("data", "fsdp", "model")` mesh of a candidate, over `devices`."""
    return jax.make_mesh(
        shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=list(devices)
    )


@dataclasses.dataclass(frozen=True)
class Job:
    """What every candidate of a plan compiles: the model (`make_model(key,
    **model_kwargs)`), the train step `step(model, opt_state, batch)`, the
    optimiser (or `None`), an example batch, and how the parameters are sharded
    (logical `axes` and `rules`, or FSDP by size when `axes` is `None`; arrays
    under `min_size` elements replicated)."""

    make_model: Callable[..., PyTree]
    model_kwargs: Mapping[str, object]
    step: Callable[..., Sequence[PyTree]]
    optimizer: "optax.GradientTransformation | None"
    batch: PyTree[jax.ShapeDtypeStruct]
    axes: Mapping[str, Names] | None
    rules: Rules | None
    min_size: int

    def model(self, key: jax.Array) -> PyTree:
        return self.make_model(key, **self.model_kwargs)


def program(
    job: Job, mesh: Mesh, remat: Remat
) -> tuple[
    jax.stages.Wrapped,
    tuple[PyTree, PyTree],
    tuple[PyTree, PyTree],
    PyTree[NamedSharding],
    PyTree,
]:
    """The jitted step of one candidate, `(params, shardings)`, `(opt_state,
    shardings)` as `ShapeDtypeStruct`s, the batch's shardings and the model's
    static part (`step` then takes and returns the model's arrays only); every
    `Stacked` gathers one layer per scan step."""
    key = jax.random.key(0)
    shape, size = eqx.filter_eval_shape(job.model, key), job.min_size
    if job.axes is None:
        specs = model_shardings(shape, mesh, fsdp_axis="fsdp", min_size=size)
    else:
        specs = logical_shardings(
            shape, mesh, job.axes, job.rules or {}, fsdp_axis="fsdp", min_size=size
        )
    # With logical axes the gathered layer stays split over "model".
    keep: tuple[str, ...] = () if job.axes is None else ("model",)

    def build(k: jax.Array) -> PyTree:
        model = with_remat(job.model(k), remat)
        return gather_layers(model, mesh, specs if keep else None, keep=keep)

    model = eqx.filter_eval_shape(build, key)
    params, static = eqx.partition(model, is_arraylike)
    p_specs = jtu.tree_unflatten(
        jtu.tree_structure(params),
        jtu.tree_leaves(eqx.filter(specs, lambda s: isinstance(s, NamedSharding))),
    )
    opt_state = o_specs = None
    if job.optimizer is not None:
        opt_state = jax.eval_shape(job.optimizer.init, params)
        o_specs = opt_state_shardings(
            opt_state, model, mesh, min_size=size, param_shardings=p_specs
        )
    b_specs = batch_shardings(job.batch, mesh, batch_axes=("data", "fsdp"))

    def train(params: PyTree, opt_state: PyTree, batch: PyTree) -> tuple:
        out = job.step(eqx.combine(params, static), opt_state, batch)
        _check_step_output(out, params, opt_state)
        model, opt_state, *rest = out
        return eqx.filter(model, eqx.is_array), opt_state, tuple(rest)

    jitted = jax.jit(
        train,
        in_shardings=(p_specs, o_specs, b_specs),
        out_shardings=(p_specs, o_specs, None),
        donate_argnums=(0, 1),
    )
    return jitted, (params, p_specs), (opt_state, o_specs), b_specs, static


def _check_step_output(out: object, params: PyTree, opt_state: PyTree) -> None:
    """`out` starts with a model of `params`' arrays and a state of `opt_state`'s
    structure, as `plan` needs to donate and place them."""
    seq = isinstance(out, (tuple, list))
    what = f"a {type(out).__name__} of {len(out)}" if seq else type(out).__name__
    what = "an array" if is_arraylike(out) else what
    shape = lambda tree: jtu.tree_structure(eqx.filter(tree, eqx.is_array))
    if not (
        seq
        and len(out) >= 2
        and shape(out[0]) == shape(params)
        and jtu.tree_structure(out[1]) == jtu.tree_structure(opt_state)
    ):
        raise ValueError(
            f"plan: step must return (model, opt_state, *rest), the model and "
            f"optimiser state it was given, updated; it returned {what}, which "
            "does not start with them.\nHint: e.g. `return model, opt_state, loss`."
        )


def _per_device_bytes(tree: PyTree, specs: PyTree[NamedSharding]) -> int:
    pairs = zip(jtu.tree_leaves(tree), jtu.tree_leaves(specs), strict=True)
    return sum(
        math.prod(spec.shard_shape(tuple(leaf.shape))) * jnp.dtype(leaf.dtype).itemsize
        for leaf, spec in pairs
    )


def compile_one(
    job: Job, mesh: Mesh, remat: Remat, accelerator: Accelerator
) -> MeshCandidate:
    """Compile one candidate and read XLA's figures of it; a candidate whose
    axes do not divide the arrays comes back with the reason as its `error`."""
    shape = (mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["model"])
    label = remat_label(remat)
    start = time.perf_counter()
    try:
        jitted, (params, p_specs), (opt_state, o_specs), _, _ = program(
            job, mesh, remat
        )
    except ValueError as e:
        return MeshCandidate(shape, label, error=str(e).splitlines()[0])
    compiled = jitted.lower(params, opt_state, job.batch).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    if mem is None:
        raise RuntimeError(
            f"plan: XLA gave no memory analysis of the {shape} {label} program."
            "\nHint: plan compiles for CPU, GPU or TPU devices, which give one."
        )
    cost = compiled.cost_analysis() or {}
    collective, matmul = hlo_costs(compiled.as_text() or "")
    # A ring all-reduce sends its bytes twice (a reduce-scatter, an all-gather).
    sent = sum(b * (2 if k == "all-reduce" else 1) for k, b in collective.items())
    return MeshCandidate(
        mesh=shape,
        remat=label,
        state_bytes=_per_device_bytes((params, opt_state), (p_specs, o_specs)),
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


def compile_all(
    job: Job,
    shapes: Sequence[MeshShape],
    remat: Sequence[Remat],
    devices: Sequence[Device],
    accelerator: Accelerator,
    progress: Progress,
) -> list[MeshCandidate]:
    """Every mesh of `shapes` with every remat setting, compiled in this process
    over `devices`."""
    settings = list(itertools.product(shapes, remat))
    out = []
    for i, (shape, setting) in enumerate(settings):
        progress(i, len(settings), f"{shape} {remat_label(setting)}")
        mesh = make_plan_mesh(shape, devices)
        out.append(compile_one(job, mesh, setting, accelerator))
    progress(len(settings), len(settings), "done")
    return out
