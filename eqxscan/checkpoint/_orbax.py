"""Sharded checkpoints with Orbax: every process writes only its own shards, and a
checkpoint restores onto any mesh and any number of processes.

Entries keep [`eqxscan.to_state_dict`][]'s names with the layer index as `*`:
`blocks.*.w1` is the stacked array whose row `i` is `blocks.i.w1` (`*.*` for
nested `Stacked`s), so a deep model is a handful of entries, not one per layer.
"""

import errno
import json
import os
import re
import warnings
from typing import Any, SupportsIndex, TypeVar

import jax

from .._internal import (
    check_size,
    docs,
    scalars_kept,
)
from ..sharding import MIN_SIZE, model_shardings, opt_state_shardings, shard
from ._files import check_path, flatten, listed
from ._in_flight import flying, landed
from ._orbax_trees import (
    as_stored,
    check_orders,
    filled,
    named_leaves,
    restore_target,
    stage_orders,
    weak_names,
)
from ._step_dirs import (
    corruption,
    DIGESTS,
    file_digests,
    incomplete,
    newest,
    steps_on_disk,
)


DOCS = f"see {docs('multihost.md')}"
_M = TypeVar("_M")
_S = TypeVar("_S")


def _check_step(step: Any, method: str) -> int:
    # A step names a directory: not a string (one outside) nor a float.
    try:
        return check_size(f"CheckpointManager.{method}: step", step, minimum=0)
    except TypeError:
        raise TypeError(
            f"CheckpointManager.{method}: step must be a non-negative int, got "
            f"{type(step).__name__} ({step!r})."
        ) from None


class CheckpointManager:
    """Sharded checkpoints of a model, its optimizer state and the step number, in
    one Orbax checkpoint per step (`orbax.checkpoint.CheckpointManager`). Needs
    Orbax: `pip install "eqxscan[orbax]"`.

    Every process calls the same methods in the same order, and writes only the
    shards its devices hold; a checkpoint restores onto any mesh and number of
    processes (saved on 2 processes x 4 devices, restored on 1 x 8 or 1 x 1).
    A step appears in `directory` only once every process has written it, so a
    process killed mid-save leaves the previous checkpoint as the latest.

    A step holds the items `model`, `opt_state` and `step`, named as by
    [`eqxscan.to_state_dict`][] with the layer index as `*` (`blocks.*.w1` in
    `model`, `0.mu.blocks.*.w1` in `opt_state`), one stacked array for every
    layer; see `docs/multihost.md`. A stack in the stage order of
    [`eqxscan.sharding.pipeline_order`][] is saved as stored, with that order:
    it restores only into a stack in the same order.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        asynchronous: bool = True,
    ):
        """**Arguments:**

        - `directory`: where the steps go, one subdirectory each; with several
          hosts, storage every host can reach (a shared file system, GCS, S3).
        - `max_to_keep`: keep only the newest this many steps (`None`: all).
        - `asynchronous`: `save` returns once the arrays are off the devices,
          writing on in the background while training runs.
        """
        # Imported here: Orbax is an extra, and `import eqxscan` does without it.
        try:
            import orbax.checkpoint as ocp
        except ImportError as e:
            if (e.name or "").split(".")[0] != "orbax":
                raise  # Orbax is there, but fails to import
            raise ImportError(
                "eqxscan.checkpoint.CheckpointManager needs Orbax, which is not "
                'installed.\nHint: pip install "eqxscan[orbax]" (or orbax-checkpoint).'
            ) from e
        self.directory = os.path.abspath(
            check_path("CheckpointManager: directory", directory)
        )
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"CheckpointManager: directory {self.directory!r} is a file.\n"
                "Hint: pass a directory (made if absent) for the steps.",
            )
        if max_to_keep is not None:
            max_to_keep = check_size("CheckpointManager: max_to_keep", max_to_keep)
        self._asynchronous = asynchronous
        self._unsealed: list[int] = []
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={
                "model": ocp.StandardCheckpointHandler(),
                "opt_state": ocp.StandardCheckpointHandler(),
                "step": ocp.JsonCheckpointHandler(),
            },
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=asynchronous,
                cleanup_tmp_directories=True,
                create=True,
                # Made in the foreground: one that cannot be made in the background
                # leaves Orbax's writers waiting (300 s each), the process hung.
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            ),
        )
        # Orbax removes leftover temporary directories in a background thread:
        # a save begun meanwhile by another manager of the directory lost its
        # own (NOT_FOUND). Removed before this manager is handed back.
        getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()

    def save(
        self,
        step: SupportsIndex,
        model: Any,
        opt_state: Any = None,
        *,
        wait: bool = False,
    ) -> None:
        """Save `model` and `opt_state` (their arrays, sharded or not) as `step`.

        **Arguments:**

        - `step`: the step number (a non-negative `int`), the checkpoint's name.
        - `model`: the model (any pytree; `Stacked` layers keep their `*` names).
        - `opt_state`: the optimizer state, or `None`.
        - `wait`: block until the checkpoint is complete, even if asynchronous.
        """
        step = _check_step(step, "save")
        args = self._ocp.args
        if not (named := named_leaves(model)):
            raise ValueError(
                "CheckpointManager.save: model holds no arrays to save.\nHint: "
                "pass the model itself (its arrays may be sharded)."
            )
        orders = {"model": stage_orders(model), "opt_state": stage_orders(opt_state)}
        record = {k: v for k, v in orders.items() if v}
        items: dict[str, Any] = {"model": args.StandardSave(as_stored(named))}
        weak = {"model": weak_names(model)}
        # A state without arrays (plain SGD's) has nothing to save: Orbax refuses
        # an empty item, and `restore` gives such a state back as it is.
        if opt_state is not None and (named := named_leaves(opt_state)):
            items["opt_state"] = args.StandardSave(as_stored(named))
            weak["opt_state"] = weak_names(opt_state)
        items["step"] = args.JsonSave(
            {"step": step, "weak": weak} | ({"stage_order": record} if record else {})
        )
        # Orbax waits for the previous save, complete now: it gets its digests.
        self._seal()
        if os.path.lexists(os.path.join(self.directory, str(step))):
            # Written by another manager or process (Orbax's list of steps is
            # this manager's own): `force=True` below would replace it.
            raise FileExistsError(
                f"CheckpointManager could not save step {step} to "
                f"{self.directory!r}: it holds a step {step} already (written by "
                f"another manager or process, or a stray file).\nHint: save under a "
                f"step number not in it, or remove that step's directory; {DOCS}."
            )
        try:
            self._manager.save(step, args=args.Composite(**items), force=True)
        except Exception as e:
            raise self._save_failed([step], e) from e
        self._unsealed.append(step)
        if wait or not self._asynchronous or not flying(self):
            self.wait()

    def restore(
        self,
        model: _M,
        opt_state: _S = None,
        *,
        mesh: jax.sharding.Mesh,
        step: SupportsIndex | None = None,
        fsdp_axis: str | None = "fsdp",
        min_size: int = MIN_SIZE,
        verify: bool = True,
        skip_corrupt: bool = False,
    ) -> tuple[_M, _S, int]:
        """Restore a step onto `mesh`, laid out as [`eqxscan.sharding.shard`][]
        lays out `model` and `opt_state`; every process reads only its shards.

        **Arguments:**

        - `model`: a model of the saved structure; its arrays may be
          `jax.ShapeDtypeStruct`s (`eqx.filter_eval_shape(make_model, ...)`).
        - `opt_state`: likewise for the optimizer state (`None`: not restored).
        - `mesh`: the mesh to restore onto; any topology.
        - `step`: the step to restore (default: the latest, once this
          manager's asynchronous saves have finished).
        - `fsdp_axis`, `min_size`: as for `shard`.
        - `verify`: first check every file of the step against the SHA-256
          digests written when it was saved (each process reads the whole step
          once more); a step without digests is restored unchecked.
        - `skip_corrupt`: with `step=None` and `verify`, restore the newest step
          whose files match their digests, skipping newer ones with a warning
          naming them (by default a corrupt latest step raises).

        **Returns:**

        `(model, opt_state, step)`. As `shard` does, it sets each `Stacked`'s
        static `layer_sharding`: compare its arrays with the saved model's
        (`jax.tree.leaves(eqx.filter(m, eqx.is_array))`), not the modules with
        `eqx.tree_equal`, which also compares static fields.

        **Raises:**

        `FileNotFoundError` if there is no such step; `ValueError` naming the
        step's file whose digest differs, or the entries missing from the
        checkpoint, missing from `model`/`opt_state`, or of another shape or
        dtype.
        """
        self.wait()  # this manager's saves in flight: the latest steps
        step, verify = self._step_to_restore(step, verify, skip_corrupt)
        kw: dict[str, Any] = {"fsdp_axis": fsdp_axis, "min_size": min_size}
        target = {"model": restore_target(model, model_shardings(model, mesh, **kw))}
        if opt_state is not None and named_leaves(opt_state):
            sh = opt_state_shardings(opt_state, model, mesh, **kw)
            target["opt_state"] = restore_target(opt_state, sh)
        if verify and (why := self._corruption(step)):
            raise ValueError(
                f"{why}.\nHint: restore another step (all_steps() lists them: "
                f"{self.all_steps()}); {DOCS}."
            )
        if opt_state is not None and "opt_state" not in target:
            # One saved is named (the hint: opt_state=None leaves it unread).
            self._check(step, target | {"opt_state": {}})
        out = self._read(step, target)
        trees = {"model": model, "opt_state": opt_state}
        saved = out["step"].get("stage_order", {})
        where = f"Step {step} in {self.directory!r}"
        check_orders(where, saved, {k: trees[k] for k in target})
        weak = out["step"].get("weak", {})
        model = filled(model, out["model"], weak.get("model"))
        if "opt_state" in target:
            opt_state = filled(opt_state, out["opt_state"], weak.get("opt_state"))
        placed = shard(model, opt_state, mesh=mesh, **kw)[:2]
        model, opt_state = scalars_kept((model, opt_state), placed)
        return model, opt_state, int(out["step"]["step"])

    def _step_to_restore(
        self, step: SupportsIndex | None, verify: bool, skip_corrupt: bool
    ) -> tuple[int, bool]:
        # The step, and whether it is still to be verified.
        if step is None:
            latest = self.latest_step()
            if latest is None:
                raise FileNotFoundError(
                    f"No complete checkpoint in {self.directory!r}.\nHint: save "
                    f"one first, or check the directory; {DOCS}."
                )
            if verify and skip_corrupt:
                return self._latest_verified(latest), False
            return latest, verify
        step = _check_step(step, "restore")
        if step not in self.all_steps():
            why = "no checkpoint of that step"
            if step in self._steps():
                why = f"its directory is incomplete: {self._incomplete(step)}"
            raise FileNotFoundError(
                f"No checkpoint of step {step} in {self.directory!r} ({why}); it "
                f"has steps {self.all_steps()}.\nHint: pass one of them or "
                f"step=None; {DOCS}."
            )
        return step, verify

    def _read(self, step: int, target: dict[str, Any]) -> Any:
        args = self._ocp.args
        try:
            self._check(step, target)
            return self._manager.restore(
                step,
                args=args.Composite(
                    step=args.JsonRestore(),
                    **{k: args.StandardRestore(v) for k, v in target.items()},
                ),
            )
        except Exception as e:
            # Orbax raises reading errors as `ValueError`, `OSError` or a bare
            # `Exception` (a truncated file); ours, from `_check`, stand.
            reading = isinstance(e, (ValueError, OSError)) or type(e) is Exception
            if str(e).startswith(f"Step {step} in ") or not reading:
                raise
            # TensorStore's messages run to kilobytes: name the item and entry.
            text = " ".join(str(e).split())
            item = re.search(rf"/{step}/(\w+)/", text)
            entry = re.search(r'Error reading "([^"]+?)/\.z', text)
            where = (f" item {item.group(1)!r}" if item else "") + (
                f" entry {entry.group(1)!r}" if entry else ""
            )
            cause = text if len(text) <= 200 else text[:197] + "..."
            raise ValueError(
                f"Step {step} in {self.directory!r} could not be read:{where or ' '}"
                f"{':' if where else ''} {cause}\nHint: its files are damaged or were "
                f"changed; restore with verify=True to check them against their "
                f"digests, or restore another step ({self.all_steps()}); {DOCS}."
            ) from e

    def _check(self, step: int, target: dict[str, Any]) -> None:
        # Orbax's own errors name tensorstore paths; name the entries instead.
        metadata = self._manager.item_metadata(step)
        # An optimizer state without arrays (SGD's) asked for, `{}` in
        # `target`: one saved with arrays is compared with it, not left unread.
        saved = flatten(
            {k: metadata[k].tree for k in target if metadata.get(k) is not None}
        )
        wanted = flatten(target)
        wrong = [
            f"'{k}': wanted {v.dtype}{list(v.shape)}, saved "
            f"{saved[k].dtype}{list(saved[k].shape)}"
            for k, v in wanted.items()
            if k in saved
            and (
                tuple(saved[k].shape) != tuple(v.shape)
                or jax.numpy.dtype(saved[k].dtype) != v.dtype
            )
        ]
        problems = [
            f"{what}: {listed(items)}"
            for what, items in (
                ("not in the checkpoint", sorted(set(wanted) - set(saved))),
                ("only in the checkpoint", sorted(set(saved) - set(wanted))),
                ("of another shape or dtype", wrong),
            )
            if items
        ]
        if problems:
            raise ValueError(
                f"Step {step} in {self.directory!r} does not match the model and "
                f"optimizer state to restore: {' | '.join(problems)}.\nHint: pass a "
                f"model and optimizer state built with the saved configuration "
                f"(opt_state=None restores the model alone); {DOCS}."
            )

    def _incomplete(self, step: int) -> str | None:
        return incomplete(self.directory, step)

    def _steps(self) -> list[int]:
        # Orbax's own list is this manager's (cached): blind to another
        # manager's or process's saves and removals.
        found = steps_on_disk(self.directory)
        return list(self._manager.all_steps()) if found is None else found

    def latest_step(self) -> int | None:
        """The newest complete step, or `None`. Newer directories that are not
        complete checkpoints (stray, emptied or partly deleted) are skipped with
        a warning naming them; this manager's saves in flight, without one."""
        # This manager's saves in flight are no strays: not warned of.
        flying = {s for s in self._unsealed if self._incomplete(s)}
        steps = [s for s in self._steps() if s not in flying]
        step, skipped = newest(steps, self._incomplete)
        if skipped:
            warnings.warn(
                f"Skipped step directories of {self.directory!r} that are not "
                f"complete checkpoints: {', '.join(skipped)}; the latest complete "
                f"step is {step}.",
                UserWarning,
                stacklevel=2,
            )
        return step

    def all_steps(self) -> list[int]:
        """Every complete step, oldest first (stray or incomplete directories
        named by a step number are left out)."""
        return [s for s in self._steps() if self._incomplete(s) is None]

    def wait(self) -> None:
        """Block until every asynchronous save has finished."""
        self._seal()

    def _seal(self) -> None:
        # The digests of the steps saved since, by process 0 (which finalises
        # the steps after every process wrote).
        pending, self._unsealed = self._unsealed, []
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            if not pending:
                raise
            raise self._save_failed(pending, e) from e
        finally:
            if not self._unsealed:  # none saved meanwhile, by another thread
                landed(self)
        if not pending or jax.process_index() != 0:
            return
        for step in pending:
            where = os.path.join(self.directory, str(step))
            if self._incomplete(step) is not None:
                continue  # deleted since (max_to_keep) or not written
            tmp = os.path.join(where, f".{DIGESTS}.tmp")
            with open(tmp, "w") as f:
                json.dump(file_digests(where), f, indent=0, sort_keys=True)
            os.replace(tmp, os.path.join(where, DIGESTS))

    def _save_failed(self, steps: list[int], error: Exception) -> Exception:
        # Naming the steps and the directory; an `OSError` keeps its type.
        cause = next(iter(str(error).strip().splitlines()), "")
        cause = cause if len(cause) <= 300 else cause[:297] + "..."
        try:
            kept = f"the complete steps in it are {self.all_steps()}"
        except Exception:
            kept = "it cannot be listed"
        which = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
        hint = "check that the directory exists and can be written (permissions, "
        hint += "free space)"
        if type(error).__name__ == "StepAlreadyExistsError":
            hint = "save under a step number not in it, or remove that step's directory"
        elif re.search("gloo|collective|coordination service", cause, re.I):
            # A save gathers across processes: a lost peer fails it first.
            hint = "another process of the job failed or was lost during the save"
        message = (
            f"CheckpointManager could not save {which} to {self.directory!r}: "
            f"{type(error).__name__}: {cause}\nHint: {hint}; {kept}; {DOCS}."
        )
        if isinstance(error, OSError):
            try:
                named = type(error)(message)
            except Exception:
                named = OSError(message)
            named.errno = error.errno  # the message kept as it is
            return named
        return RuntimeError(message)

    def _latest_verified(self, latest: int) -> int:
        steps = [s for s in self.all_steps() if s <= latest]
        step, skipped = newest(steps, self._corruption)
        if step is None:
            raise ValueError(
                f"Every step of {self.directory!r} is corrupt: {'; '.join(skipped)}"
                f"\nHint: restore one with verify=False at your own risk; {DOCS}."
            )
        if skipped:
            warnings.warn(
                f"Skipped corrupt steps of {self.directory!r}: "
                f"{'; '.join(skipped)}; restoring step {step}.",
                UserWarning,
                stacklevel=3,
            )
        return step

    def _corruption(self, step: int) -> str | None:
        return corruption(self.directory, step)

    def close(self) -> None:
        """Finish pending saves and release Orbax's resources."""
        try:
            self._seal()
        finally:
            self._manager.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
