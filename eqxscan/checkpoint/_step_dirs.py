"""What a checkpoint's step directory holds: whether it is complete, and the
SHA-256 digests of its files (Orbax checks none of the data it reads back)."""

import hashlib
import json
import os
from collections.abc import Callable, Sequence


#: What every complete step directory holds (Orbax writes its metadata last).
COMPLETE = ("_CHECKPOINT_METADATA", "model", "step")
#: The SHA-256 of every file of a complete step, written by process 0.
DIGESTS = "eqxscan_digests.json"


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digests(where: str) -> dict[str, str]:
    paths = [os.path.join(r, n) for r, _, names in os.walk(where) for n in names]
    return {
        rel: sha256_file(path)
        for path in paths
        if (rel := os.path.relpath(path, where)) not in (DIGESTS, f".{DIGESTS}.tmp")
    }


def steps_on_disk(directory: str) -> list[int] | None:
    """Every directory entry named by a step number, oldest first (`None` if
    the directory cannot be listed)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    return sorted(int(n) for n in names if n.isdigit())


def incomplete(directory: str, step: int) -> str | None:
    """Why `step` is no complete checkpoint, or `None`. Orbax lists any
    integer's directory, a stray or emptied one too; a cleanup killed midway
    leaves a step without some of the files its digests list."""
    where = os.path.join(directory, str(step))
    for part in COMPLETE:
        if not os.path.exists(os.path.join(where, part)):
            return f"it has no {part!r}"
    try:
        with open(os.path.join(where, DIGESTS)) as f:
            listed = json.load(f)
    except (OSError, ValueError):
        return None  # no digests (yet): `restore(verify=True)` says so
    if isinstance(listed, dict):
        for rel in listed:
            if not os.path.exists(os.path.join(where, str(rel))):
                return f"it has no {str(rel)!r}"
    return None


def corruption(directory: str, step: int) -> str | None:
    """The first file of `step` that differs from its digest; `None` if all
    match or there are none (saved before digests, or killed first)."""
    where = os.path.join(directory, str(step))
    corrupt = f"Step {step} in {directory!r} is corrupt"
    try:
        with open(os.path.join(where, DIGESTS)) as f:
            saved = json.load(f)
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as e:
        return f"{corrupt}: its digest file {DIGESTS!r} cannot be read ({e})"
    if not isinstance(saved, dict) or not saved:  # `[]` or `{}` checked nothing
        return f"{corrupt}: its digest file {DIGESTS!r} lists no files"
    for name, digest in sorted(saved.items()):
        try:
            found = sha256_file(os.path.join(where, name))
        except (FileNotFoundError, IsADirectoryError):
            return f"{corrupt}: its file {name!r} is missing"
        if found != digest:
            return (
                f"{corrupt}: its file {name!r} differs from its digest (SHA-256 "
                "written when the step was saved)"
            )
    return None


def newest(
    steps: Sequence[int], problem: Callable[[int], str | None]
) -> tuple[int | None, list[str]]:
    """The newest step without a problem, and `"step (problem)"` of newer ones."""
    skipped = []
    for step in sorted(steps, reverse=True):
        why = problem(step)
        if why is None:
            return step, skipped
        skipped.append(f"{step} ({why})")
    return None, skipped
