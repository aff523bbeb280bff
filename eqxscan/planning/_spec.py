"""A plan's work in JSON, for the fresh process that compiles it: the model
builder, step and optimiser by reference (`"module:attribute"`), the batch's
shapes and dtypes, the remat settings by name, and back."""

import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TYPE_CHECKING, TypeAlias, TypedDict

import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._internal import Remat
from ._candidates import Job, Names, Rules
from ._report import Accelerator, MeshShape


if TYPE_CHECKING:
    import optax


#: A JSON value as `json.load` gives it.
Json: TypeAlias = Any
#: What `plan` takes as its optimiser: a transform, a function returning one, a
#: reference to either, or `None`.
Optimizer: TypeAlias = "optax.GradientTransformation | Callable[[], optax.GradientTransformation] | str | None"  # noqa: E501


class Spec(TypedDict):
    """A plan's work, as the child process reads it."""

    devices: int
    meshes: list[list[int]]
    remat: list[Json]
    make_model: str
    step: str
    optimizer: str | None
    batch: Json
    axes: dict[str, list[str | None]] | None
    rules: dict[str, str | list[str] | None] | None
    model_kwargs: dict[str, Json]
    min_size: int
    accelerator: list[float]


def resolve(ref: str, what: str) -> object:
    """The object a `"module:attribute"` reference names."""
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


def reference(obj: object, what: str) -> str:
    """`obj`'s `"module:attribute"` reference, checked to import back as `obj`."""
    if isinstance(obj, str):
        if ":" not in obj:
            raise ValueError(
                f"plan: {what} {obj!r} is not a reference.\nHint: write it as "
                "'package.module:function'."
            )
        resolve(obj, what)
        return obj
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None)
    ref = f"{module}:{name}"
    ok = module not in (None, "__main__") and bool(name) and "<" not in str(name)
    try:
        ok = ok and resolve(ref, what) is obj
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


def _function(obj: Callable[..., Any] | str, what: str) -> Callable[..., Any]:
    found = resolve(obj, what) if isinstance(obj, str) else obj
    if not callable(found):
        raise ValueError(
            f"plan: {what} {obj!r} is not callable.\nHint: pass a function or "
            "'module:function'."
        )
    return found


def make_job(
    make_model: Callable[..., PyTree] | str,
    step: Callable[..., Sequence[PyTree]] | str,
    optimizer: Optimizer,
    batch: PyTree[jax.ShapeDtypeStruct],
    axes: Mapping[str, Names] | None,
    rules: Rules | None,
    model_kwargs: Mapping[str, object],
    min_size: int,
) -> Job:
    """The `Job` of `plan`'s arguments, references resolved (an optimiser given
    as a function called)."""
    build, train = _function(make_model, "make_model"), _function(step, "step")
    tx = optimizer
    if tx is not None:
        # Imported here, for an optimiser only: optax is an extra.
        import optax

        if not isinstance(tx, optax.GradientTransformation):
            tx = _function(tx, "optimizer")()
    return Job(build, model_kwargs, train, tx, batch, axes, rules, min_size)


def _encode_batch(batch: PyTree[jax.ShapeDtypeStruct]) -> Json:
    if isinstance(batch, jax.ShapeDtypeStruct):
        return {"shape": list(batch.shape), "dtype": jnp.dtype(batch.dtype).name}
    # Lists, tuples and dict keys come back as given (keys as strings, a list
    # as a tuple, reached the step compiled in a fresh process: a KeyError).
    if isinstance(batch, (tuple, list)):
        return {
            "seq": [_encode_batch(b) for b in batch],
            "list": isinstance(batch, list),
        }
    if isinstance(batch, dict):
        if bad := [k for k in batch if type(k) not in (str, int)]:
            raise TypeError(
                f"plan: batch dict key {bad[0]!r} ({type(bad[0]).__name__}) cannot "
                "be passed to the fresh process that compiles the candidates.\n"
                "Hint: key the batch by strings or ints."
            )
        return {"map": [[k, _encode_batch(v)] for k, v in batch.items()]}
    raise TypeError(
        f"plan: batch must be jax.ShapeDtypeStructs in tuples, lists or dicts, got "
        f"{type(batch).__name__}.\nHint: jax.ShapeDtypeStruct((B, T), jnp.int32)."
    )


def _encode_remat(c: Remat) -> Json:
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


def _encode_optimizer(optimizer: Optimizer) -> str | None:
    if optimizer is None:
        return None
    import optax  # imported here, for an optimiser only: optax is an extra

    if isinstance(optimizer, optax.GradientTransformation):
        raise ValueError(
            "plan: an optax.GradientTransformation object cannot be passed to the "
            "fresh process that compiles the candidates.\nHint: pass a top-level "
            "function returning it, or 'module:function'."
        )
    return reference(optimizer, "optimizer")


def _first_rules(rules: Rules) -> dict:
    # JSON keeps a dict; of `(name, axis)` pairs naming one name twice the first
    # wins, as in `logical_spec` (`dict` would keep the last).
    pairs = list(rules.items() if isinstance(rules, Mapping) else rules)
    return dict(reversed(pairs))


def encode(
    devices: int,
    shapes: Sequence[MeshShape],
    remat: Sequence[Remat],
    accelerator: Accelerator,
    job: tuple,
) -> Spec:
    """`plan`'s work as JSON (`job`: the arguments of `make_job`); raises if a
    part of it cannot be passed."""
    make_model, step, optimizer, batch, axes, rules, model_kwargs, min_size = job
    spec = Spec(
        devices=devices,
        meshes=[list(m) for m in shapes],
        remat=[_encode_remat(c) for c in remat],
        make_model=reference(make_model, "make_model"),
        step=reference(step, "step"),
        optimizer=_encode_optimizer(optimizer),
        batch=_encode_batch(batch),
        axes=None if axes is None else {k: list(v) for k, v in axes.items()},
        rules=None if rules is None else _first_rules(rules),
        model_kwargs=dict(model_kwargs),
        min_size=min_size,
        accelerator=list(accelerator),
    )
    try:
        json.dumps(spec["model_kwargs"], allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"plan: model_kwargs cannot be passed as JSON to the fresh process "
            f"that compiles the candidates ({e}).\nHint: pass numbers, strings, "
            "lists and dicts, e.g. dtype='bfloat16', and convert them in make_model."
        ) from None
    return spec


def _decode_batch(d: Json) -> PyTree[jax.ShapeDtypeStruct]:
    if "shape" in d:
        return jax.ShapeDtypeStruct(tuple(d["shape"]), jnp.dtype(d["dtype"]))
    if "seq" in d:
        seq = [_decode_batch(b) for b in d["seq"]]
        return seq if d.get("list") else tuple(seq)
    return {k: _decode_batch(v) for k, v in d["map"]}


def decode(spec: Spec) -> tuple[Job, list[MeshShape], list[Remat], Accelerator]:
    """The job, meshes, remat settings and accelerator figures of `spec`."""
    axes = spec["axes"]
    job = make_job(
        spec["make_model"],
        spec["step"],
        spec["optimizer"],
        _decode_batch(spec["batch"]),
        None if axes is None else {k: tuple(v) for k, v in axes.items()},
        spec["rules"],
        spec["model_kwargs"],
        spec["min_size"],
    )
    shapes: list[MeshShape] = [(d, f, m) for d, f, m in spec["meshes"]]
    policy = lambda c: getattr(jax.checkpoint_policies, c["policy"])
    remat = [policy(c) if isinstance(c, dict) else c for c in spec["remat"]]
    return job, shapes, remat, Accelerator(*spec["accelerator"])
