"""Several processes on 127.0.0.1 (JAX's distributed runtime, gloo on CPU), sharded
creation and Orbax checkpoints.

Few processes are started, because each costs seconds: one 2 x 4 job and one 1 x 8
process run tests/scripts/multihost_checks.py and write what they measured; the 1 x 1
reference runs here. Every process has a timeout and is killed at the end.
"""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import eqxscan
from eqxscan import checkpoint, distributed, sharding
from eqxscan.sharding._create import lower_create

from .helpers import free_port, processes, script_path
from .scripts.training import make_train_step


ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKS = script_path("multihost_checks.py")
DIM, LAYERS, BATCH = 16, 3, 16  # as in multihost_checks.py
TIMEOUT = 240


def env() -> dict[str, str]:
    out = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    # Each script adds its own device count to the tests' compile flags.
    out["XLA_FLAGS"] = os.environ.get("EQXSCAN_TEST_XLA_FLAGS", "")
    paths = [str(ROOT), out.get("PYTHONPATH")]
    out["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return out


def start(*argv: str, log: pathlib.Path) -> subprocess.Popen:
    with log.open("w") as f:  # the child keeps its own handle
        return subprocess.Popen(
            [sys.executable, *argv],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env(),
            cwd=ROOT,
        )


def tail(path: pathlib.Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@pytest.fixture(scope="module")
def runs():
    """Run the 2 x 4 job up to the frozen save of step 7, SIGKILL it there, then
    the 1 x 8 process; return what they wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        port = str(free_port())
        logs = [out / f"two_{i}.log" for i in range(2)]
        two = [
            start(
                *(str(CHECKS), "two", "--process-id", str(i), "--port", port),
                *("--out", str(out)),
                log=logs[i],
            )
            for i in range(2)
        ]
        with processes(*two):
            deadline = time.monotonic() + TIMEOUT
            while not (out / "committing").exists():
                failed = [p.poll() for p in two if p.poll() is not None]
                assert not failed and time.monotonic() < deadline, (
                    f"2 x 4 job: exit statuses {failed}\n{tail(logs[0])}\n"
                    f"{tail(logs[1])}"
                )
                time.sleep(0.2)
            killed_during = sorted(os.listdir(out / "ckpt"))
        eight_log = out / "eight.log"
        eight = start(str(CHECKS), "eight", "--out", str(out), log=eight_log)
        with processes(eight):
            assert eight.wait(timeout=TIMEOUT) == 0, tail(eight_log)
        result = {
            name: json.loads((out / f"{name}.json").read_text())
            for name in ("two", "eight")
        }
        for f in out.glob("*.npz"):
            with np.load(f) as data:
                result[f.stem] = dict(data)
        result["killed_during"] = killed_during
        # The 1 x 1 restores, here, from what the 2 x 4 job saved.
        result["ckpt"] = str(out / "ckpt")
        yield result


def group(arrays: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
    return {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith(name)}


def by_path(tree) -> dict[str, np.ndarray]:
    leaves = jtu.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    return {jtu.keystr(p): np.asarray(x) for p, x in leaves}


def assert_close(got: dict, want: dict, rtol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for k in want:
        scale = float(np.max(np.abs(want[k]))) + 1e-30
        err = float(np.max(np.abs(got[k].astype(np.float64) - want[k]))) / scale
        assert err <= rtol, (k, err)


def make_model(key):
    return eqxscan.StackedMLP(DIM, LAYERS, key=key)


def make_model_of_depth(layers, key):
    return eqxscan.StackedMLP(DIM, layers, key=key)


def batch(step: int):
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(1), step))
    return jax.random.normal(kx, (BATCH, DIM)), jax.random.normal(ky, (BATCH, DIM))


optimizer = optax.adam(1e-2)


def reference(steps: int, model=None, opt_state=None, first: int = 0):
    """The unsharded run on one device."""
    if model is None:
        model = make_model(jax.random.key(0))
        opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step = make_train_step(optimizer, None)
    for i in range(first, steps):
        model, opt_state, loss, grads = step(model, opt_state, *batch(i))
    return model, opt_state, float(loss), grads


def abstract():
    like = eqx.filter_eval_shape(make_model, jax.random.key(0))
    opt_like = eqx.filter_eval_shape(
        lambda m: optimizer.init(eqx.filter(m, eqx.is_array)), like
    )
    return like, opt_like


def test_two_by_four_and_one_by_eight_equal_one_device(runs):
    model, opt_state, loss, grads = reference(3)
    assert runs["two"]["processes"] == 2 and runs["eight"]["processes"] == 1
    for name in ("two", "eight"):
        assert abs(runs[name]["loss3"] - loss) <= 1e-5 * abs(loss)
        after = runs[f"{name}_after3"]
        assert_close(group(after, "model"), by_path(model))
        assert_close(group(after, "grads"), by_path(grads))
        # Adam's count, mu and nu.
        assert_close(group(after, "opt_state"), by_path(opt_state))
        assert len(group(after, "opt_state")) == 7


def test_mesh_puts_data_across_processes(runs):
    two = runs["two"]
    # Row i of the (data=2, fsdp=4) mesh is process i's four devices.
    assert two["mesh_rows_processes"] == [[0], [1]]
    assert two["local_rows"] == [[0, 8], [8, 16]]
    assert "whose devices hold 4 of the batch's 8 blocks" in two["batch_error"]
    assert "multiple of 4 rows" in two["batch_error"]


def test_sharded_creation_equals_unsharded(runs):
    # Bit for bit what the same program computes unsharded; within float
    # rounding of the eager constructor (XLA fuses the init's scaling).
    created = group(runs["created"], "model")
    key = jax.random.key(0)
    assert_close(created, by_path(eqx.filter_jit(make_model)(key)), 0)
    assert_close(created, by_path(make_model(key)), 1e-6)
    two = runs["two"]
    # fsdp=4: each device builds and keeps a quarter of the model, and the
    # creating program never holds a whole copy.
    assert two["model_shard_bytes"] == two["model_bytes"] // 4
    assert two["create_output_bytes"] <= two["model_bytes"] / 4 + 64
    assert two["create_output_bytes"] + two["create_temp_bytes"] < two["model_bytes"]
    assert two["spec_w1"] == "P(None, None, 'fsdp')"


def test_fsdp_bytes_per_device(runs):
    two = runs["two"]
    # Parameters and Adam state split 4 ways, the batch 8 ways (Adam's count:
    # 4 replicated bytes).
    expected = two["state_bytes"] / 4 + two["batch_bytes"] / 8
    assert expected <= two["step_arg_bytes"] <= expected + 16


def test_checkpoint_across_topologies(runs):
    two, eight = runs["two"], runs["eight"]
    assert two["steps_saved"] == [3, 6]
    # Saved on 2 x 4, restored on the same processes with another mesh ...
    assert two["restored_step_other_mesh"] == 3
    assert two["restored_spec_other_mesh"] == (
        "P(None, None, 'fsdp'){'data': 1, 'fsdp': 8}"
    )
    assert_close(
        group(runs["two_restored3"], "model"), group(runs["two_after3"], "model"), 0
    )
    # ... on 1 x 8 ...
    assert eight["latest_restored"] == 6
    for part in ("model", "opt_state"):
        assert_close(
            group(runs["eight_restored6"], part), group(runs["two_after6"], part), 0
        )
    # ... and on 1 x 1, here.
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    like, opt_like = abstract()
    with checkpoint.CheckpointManager(runs["ckpt"]) as ckpt:
        model, opt_state, step = ckpt.restore(like, opt_like, mesh=mesh, min_size=0)
    assert step == 6
    assert_close(by_path(model), group(runs["two_after6"], "model"), 0)
    assert_close(by_path(opt_state), group(runs["two_after6"], "opt_state"), 0)


def test_resume_equals_uninterrupted(runs):
    two, eight = runs["two"], runs["eight"]
    # Saved at step 3 on 2 x 4 (asynchronously, while steps 4-6 ran), resumed
    # on 1 x 8 and on 1 x 1: the same loss at step 6 as without interruption.
    assert abs(eight["resumed_loss6"] - two["loss6"]) <= 1e-5 * two["loss6"]
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    like, opt_like = abstract()
    with checkpoint.CheckpointManager(runs["ckpt"]) as ckpt:
        model, opt_state, step = ckpt.restore(
            like, opt_like, mesh=mesh, step=3, min_size=0
        )
    assert step == 3
    loss = reference(6, model, opt_state, first=3)[2]
    assert abs(loss - two["loss6"]) <= 1e-5 * two["loss6"]
    assert abs(loss - reference(6)[2]) <= 1e-5 * abs(loss)


def test_killed_save_leaves_last_checkpoint(runs):
    # The job was killed with step 7 written but not committed: Orbax's
    # temporary directory was there, and no step 7 ever became visible.
    assert runs["killed_during"] == ["3", "6", "7.orbax-checkpoint-tmp"]
    assert runs["eight"]["steps_after_kill"] == [3, 6]
    assert runs["eight"]["latest_restored"] == 6


def test_process_that_cannot_join_fails_fast(tmp_path):
    # Process 0 of 2 whose peer never starts, and process 1 of 2 whose
    # coordinator never starts: both report within the timeout (3 s) plus start-up.
    cases = [("0", free_port()), ("1", free_port())]
    logs = [tmp_path / f"join_{i}.log" for i, _ in cases]
    begin = time.monotonic()
    procs = [
        start(
            *(str(CHECKS), "join", "--process-id", i, "--port", str(port)),
            *("--timeout", "3"),
            log=log,
        )
        for (i, port), log in zip(cases, logs)
    ]
    with processes(*procs):
        codes = [p.wait(timeout=120) for p in procs]
    elapsed = time.monotonic() - begin
    for (i, port), log, code in zip(cases, logs, codes):
        text = log.read_text()
        assert code == 1, text
        assert (
            f"process {i} of 2 (coordinator 127.0.0.1:{port}) waited 3 s for all "
            "processes to join the job, and not all did." in text
        ), text
        assert "Hint: start every process with the same coordinator" in text
        assert "joined" not in text
    assert elapsed < 90


def test_initialize_checks_arguments():
    with pytest.raises(ValueError, match="Give coordinator_address, num_processes"):
        distributed.initialize("127.0.0.1:1234", 2)
    with pytest.raises(ValueError, match=r"process_id=2 is outside 0\.\.1"):
        distributed.initialize("127.0.0.1:1234", 2, 2)
    # Seconds may be ints: the arguments pass the type check and reach the checks.
    with pytest.raises(ValueError, match=r"process_id=2 is outside 0\.\.1"):
        distributed.initialize(
            "127.0.0.1:1234", 2, 2, timeout=5, heartbeat_timeout=6, shutdown_timeout=7
        )
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        distributed.initialize(timeout=0)


def test_initialize_refuses_an_address_the_runtime_would_crash_on():
    # JAX's runtime ends the process with a segmentation fault on a port that is
    # not a number, or taken; a port out of range it silently changes.
    # Port 0 would have process 0 listen on a port no other process knows.
    bad = ("127.0.0.1", "127.0.0.1:abc", "127.0.0.1:70000", ":1234", "127.0.0.1:0")
    for address in bad:
        with pytest.raises(ValueError, match="must be 'host:port' with a port in"):
            distributed.initialize(address, 2, 1)
    # An IPv6 host has colons of its own: the port is after the last one, and the
    # address passes on to the next check.
    with pytest.raises(ValueError, match=r"process_id=2 is outside 0\.\.1"):
        distributed.initialize("[::1]:1234", 2, 2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot listen on port {port}"):
            distributed.initialize(f"127.0.0.1:{port}", 2, 0)


def final_loss(stdout: str, processes: int, devices: int) -> float:
    last = stdout.strip().splitlines()[-1]
    m = re.fullmatch(
        rf"final loss: (\S+) after 6 steps on {processes} processes x {devices} "
        "devices",
        last,
    )
    assert m, last
    digits = re.sub(r"e.*", "", m.group(1)).replace(".", "").lstrip("0")
    assert len(digits) == 8, m.group(1)
    return float(m.group(1))


def test_example_on_two_processes_and_resumed_on_one(tmp_path):
    example = str(ROOT / "examples" / "sharded_training.py")
    common = ["--dim", "32", "--layers", "2", "--batch", "16", "--steps", "6"]
    ckpt = tmp_path / "ckpt"
    two = subprocess.run(
        [sys.executable, example, "--processes", "2", "--devices-per-process", "4"]
        + [*common, "--checkpoint-dir", str(ckpt), "--save-every", "3"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=TIMEOUT,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    uninterrupted = final_loss(two.stdout, 2, 4)
    assert sorted(os.listdir(ckpt)) == ["3", "6"]
    # Resume from step 3 alone, on one process with one device.
    (tmp_path / "from3").mkdir()
    os.rename(ckpt / "3", tmp_path / "from3" / "3")
    one = subprocess.run(
        [sys.executable, example, "--devices-per-process", "1", *common]
        + ["--checkpoint-dir", str(tmp_path / "from3"), "--resume"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=TIMEOUT,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert "restored step 3" in one.stdout
    resumed = final_loss(one.stdout, 1, 1)
    assert abs(resumed - uninterrupted) <= 1e-5 * abs(uninterrupted)


def test_single_process_checkpoints(tmp_path, getkey):
    mesh = sharding.make_mesh()
    model = sharding.create(make_model, getkey(), mesh=mesh, min_size=0)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    model, opt_state, _ = sharding.shard(model, opt_state, mesh=mesh, min_size=0)
    with checkpoint.CheckpointManager(tmp_path, max_to_keep=2, asynchronous=False) as c:
        with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
            c.restore(model, mesh=mesh)
        for step in (1, 2, 3):
            c.save(step, model, opt_state)
        assert c.all_steps() == [2, 3]  # keep-last-N
        with pytest.raises(FileNotFoundError, match=r"step 1 .* steps \[2, 3\]"):
            c.restore(model, mesh=mesh, step=1)
        restored, _, step = c.restore(model, mesh=mesh, min_size=0)
        assert step == 3
        assert_close(by_path(restored), by_path(model), 0)
        # The model alone, into a model of another depth: named mismatches.
        deeper = eqx.filter_eval_shape(make_model_of_depth, LAYERS + 1, getkey())
        with pytest.raises(
            ValueError,
            match=r"of another shape or dtype: 'model\.blocks\.\*\.w1': wanted "
            r"float32\[4, 16, 64\], saved float32\[3, 16, 64\]",
        ):
            c.restore(deeper, mesh=mesh)


def test_restore_after_an_asynchronous_save_restores_it(tmp_path, getkey):
    # Not the step before, nor "no complete checkpoint": the save is in flight,
    # not an incomplete directory.
    mesh = sharding.make_mesh()
    first, second = make_model(getkey()), make_model(getkey())
    with checkpoint.CheckpointManager(tmp_path) as c:
        c.save(1, first)
        c.save(2, second)
        assert c.latest_step() in (1, 2)  # without a warning of step 2 in flight
        restored, _, step = c.restore(first, mesh=mesh)
        assert step == 2 and c.latest_step() == 2
    assert_close(by_path(restored), by_path(second), 0)


def test_restore_keeps_weakly_typed_arrays_weak(tmp_path, getkey):
    # Orbax restores arrays strongly typed: PReLU's float32 slope would then
    # turn the bfloat16 activations float32.
    def block(key):
        linear = eqx.nn.Linear(4, 4, key=key, dtype=jax.numpy.bfloat16)
        return eqx.nn.Sequential([linear, eqx.nn.Lambda(eqx.nn.PReLU())])

    model = eqxscan.Stacked(block, 2, key=getkey())
    with checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        c.save(1, model)
        restored, _, _ = c.restore(model, mesh=sharding.make_mesh())
    assert restored.layers.layers[1].fn.negative_slope.weak_type
    x = jax.numpy.ones(4, jax.numpy.bfloat16)
    assert restored(x).dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(restored(x), model(x))


def test_restore_types_arrays_as_saved(tmp_path, getkey):
    # Trained, the slope is strong (an optimizer's update made it so): restored
    # into a fresh model, whose slope is weak, it stays strong, as the run it
    # resumes computed; the optimizer state's arrays likewise.
    def block(key):
        linear = eqx.nn.Linear(4, 4, key=key, dtype=jax.numpy.bfloat16)
        return eqx.nn.Sequential([linear, eqx.nn.Lambda(eqx.nn.PReLU())])

    model = eqxscan.Stacked(block, 2, key=getkey())
    params = eqx.filter(model, eqx.is_array)
    updates = jax.tree.map(lambda p: jax.numpy.full(p.shape, 0.5, p.dtype), params)
    trained = eqx.apply_updates(model, updates)
    fresh_state = (params, jax.numpy.asarray(0.25))  # weak
    state = (updates, jax.numpy.asarray(0.25, jax.numpy.float32))  # strong
    slope = lambda m: m.layers.layers[1].fn.negative_slope
    assert slope(model).weak_type and not slope(trained).weak_type
    with checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        c.save(1, trained, state)
        mesh = sharding.make_mesh()
        restored, opt_state, _ = c.restore(model, fresh_state, mesh=mesh)
    weak = lambda t: [x.weak_type for x in jax.tree.leaves(t)]
    assert weak(restored) == weak(trained) and not slope(restored).weak_type
    assert weak(opt_state) == weak(state) and not opt_state[1].weak_type
    arrays = lambda t: jax.tree.leaves(eqx.filter(t, eqx.is_array))
    assert eqx.tree_equal(arrays(restored), arrays(trained))
    assert eqx.tree_equal(arrays(opt_state), arrays(state))


def test_create_on_one_process(getkey):
    key = getkey()
    mesh = sharding.make_mesh(fsdp=2)
    model = sharding.create(make_model, key, mesh=mesh, min_size=0)
    assert model.blocks.layer_sharding is not None
    assert str(model.blocks.layers.w1.sharding.spec) == "P(None, None, 'fsdp')"
    assert_close(by_path(model), by_path(eqx.filter_jit(make_model)(key)), 0)
    want = by_path(make_model(key))
    assert_close(by_path(model), want, 1e-6)
    total = sum(x.nbytes for x in want.values())
    memory = (
        lower_create(make_model, key, mesh=mesh, min_size=0).compile().memory_analysis()
    )
    assert memory.output_size_in_bytes <= total / 2 + 64
    # Static arguments and keyword arguments reach the constructor.
    mlp = sharding.create(
        eqxscan.StackedMLP, 8, 2, key=key, mesh=mesh, fsdp_axis=None, min_size=0
    )
    assert mlp.blocks.layer_sharding is None and mlp.blocks.num_layers == 2
    assert distributed.local_rows(6, mesh) == slice(0, 6)
    with pytest.raises(ValueError, match=r"(?s)batch of 5 rows .* multiple of 2 rows"):
        distributed.local_rows(5, mesh)
    want = by_path(eqxscan.StackedMLP(8, 2, key=key))
    assert_close(by_path(mlp), want, 1e-6)


def test_initialize_twice_says_so():
    # In a process of its own: the job it joins lasts as long as the process.
    code = (
        "from eqxscan import distributed\n"
        f"address = '127.0.0.1:{free_port()}'\n"
        "distributed.initialize(address, 1, 0, timeout=60)\n"
        "try:\n"
        "    distributed.initialize(address, 1, 0, timeout=60)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert "initialize was called before in this process" in out.stdout, out


def test_local_rows_refuses_an_axis_the_mesh_lacks():
    # A misspelt axis was dropped, handing every process every row.
    mesh = sharding.make_mesh(fsdp=2)
    assert distributed.local_rows(6, mesh, batch_axes="fsdp") == slice(0, 6)
    with pytest.raises(ValueError, match=r"batch_axes \('dat',\) names mesh axes"):
        distributed.local_rows(6, mesh, batch_axes="dat")


def test_local_rows_refuses_what_is_not_a_row_count_or_a_mesh():
    # -3 rows gave slice(0, -3) (the last rows dropped), 8.0 and True passed
    # as bounds, a JAX int was unhashable, a string mesh an AttributeError.
    mesh = sharding.make_mesh(fsdp=2)
    assert distributed.local_rows(np.int64(8), mesh) == slice(0, 8)
    assert distributed.local_rows(jax.numpy.int32(8), mesh) == slice(0, 8)
    assert distributed.local_rows(0, mesh) == slice(0, 0)
    with pytest.raises(ValueError, match=r"local_rows: rows must be >= 0, got -3"):
        distributed.local_rows(-3, mesh, batch_axes=())
    for rows in (8.0, True):
        with pytest.raises(TypeError, match=r"local_rows: rows must be an int"):
            distributed.local_rows(rows, mesh)
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh, got str"):
        distributed.local_rows(8, "mesh")  # type: ignore[arg-type]
