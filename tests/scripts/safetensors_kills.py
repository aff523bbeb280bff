"""Overwrite a safetensors checkpoint, killed (SIGKILL) at each file event in turn.

Usage: `python safetensors_kills.py DIR OLD,NEW ...`, where OLD and NEW are the
`max_shard_size` of the checkpoint there and of the one saved over it (0: one
unsharded file). For each pair and each k, a forked child saves over a fresh
copy of the old checkpoint and kills itself just before its k-th file event
(a rename, link, removal or fsync); the parent then reads the directory. Prints
one JSON line per kill: `{"pair", "k", "killed", "loads": "old"|"new"|error,
"files_after_next_save"}`, until a save runs to its end unkilled.
"""

import json
import os
import signal
import sys
import warnings


# The child only moves NumPy arrays to files; it runs no JAX computation.
warnings.filterwarnings("ignore", "os.fork")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import eqxscan  # noqa: E402


EVENTS = ("replace", "rename", "link", "remove", "unlink", "fsync")


def host(seed):
    model = eqxscan.StackedMLP(8, 3, key=jax.random.key(seed))
    return jax.tree.map(lambda x: np.asarray(x) if eqx.is_array(x) else x, model)


def kill_at(k):
    count = [0]

    def wrap(real):
        def event(*args, **kwargs):
            if count[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)
            count[0] += 1
            return real(*args, **kwargs)

        return event

    for name in EVENTS:
        setattr(os, name, wrap(getattr(os, name)))


def which(where, models):
    try:
        state = eqxscan.read_safetensors(where)
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    for name, model in models.items():
        want = eqxscan.to_state_dict(model)
        if sorted(state) == sorted(want) and all(
            state[n].dtype == v.dtype and np.array_equal(state[n], v)
            for n, v in want.items()
        ):
            return name
    return "neither: other arrays"


def main(root, pairs):
    models = {"old": host(0), "new": host(1)}
    for pair in pairs:
        before, after = (int(x) or None for x in pair.split(","))
        for k in range(1000):
            where = os.path.join(root, f"{pair}-{k}")
            os.makedirs(where)
            eqxscan.save_safetensors(where, models["old"], max_shard_size=before)
            pid = os.fork()
            if pid == 0:
                kill_at(k)
                eqxscan.save_safetensors(where, models["new"], max_shard_size=after)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            killed = os.WIFSIGNALED(status)
            loads = which(where, models)
            # And the next save removes what the killed one left.
            eqxscan.save_safetensors(where, models["new"], max_shard_size=after)
            files = sorted(os.listdir(where))
            line = {"pair": pair, "k": k, "killed": killed, "loads": loads}
            line["files_after_next_save"] = files
            print(json.dumps(line), flush=True)
            if not killed:
                break


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
