"""`python -m benchmarks.bench --grid` at its smallest: one tiny point with two
explicit settings compiled, timed and compared, the default found to be the same
program as one of them; the loop's memory extrapolated past `MAX_LOOP_LENGTH`."""

import json
import os

import numpy as np
import pytest

from benchmarks.bench import _cli, _grid


def test_tiny_grid_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(_grid, "MLP_POINTS", [])
    monkeypatch.setattr(_grid, "RNN_POINTS", [("gru", 4, 3)])
    monkeypatch.setattr(_grid, "ROUND_BUDGET_S", 0.0)
    monkeypatch.setattr(_grid, "EXPLICIT", ((False, 1), (True, 1)))
    assert _cli.main(["--grid", "--repeats", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "grid.json").read_text())
    (gru,) = results["points"]
    names = {"default", "loop", "save-all/u1", "remat/u1", "save-all/full"}
    assert set(gru["temp_bytes"]) == set(gru["times"]) == names
    assert all(len(t) == 2 for t in gru["times"].values())
    # Three small steps: unrolled fully, which is the loop's very program (so the
    # same temp memory), and so judged at the loop's speed.
    assert gru["choice"]["label"] == gru["twin"] == "save-all/full"
    assert gru["loop_program"]
    assert gru["temp_bytes"]["default"] == gru["temp_bytes"]["loop"]
    s = gru["summary"]
    assert s["default_vs_loop"] == 1.0
    # Ratios come from the confirming rounds (the default, the loop and the best
    # chosen on the first rounds, timed again); the first rounds' are kept.
    again = gru["confirm"]["times"]
    assert set(again) == {"default", "loop", s["best"]}
    assert s["default_vs_loop_measured"] == pytest.approx(
        np.median(np.asarray(again["default"]) / again["loop"])
    )
    assert s["selection"]["default_vs_loop_measured"] == pytest.approx(
        np.median(np.asarray(gru["times"]["default"]) / gru["times"]["loop"])
    )
    table = (tmp_path / "grid.md").read_text()
    assert "| GRU H=4 T=3 | save-all/full | 1.00× |" in table
    assert f"loop ({s['default_vs_loop_measured']:.2f}×), save-all/full (" in table
    assert (tmp_path / "grid.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert table in out
    # The cores XLA may use change which settings are fastest: recorded (as
    # `taskset` leaves them), and printed first.
    cores = len(os.sched_getaffinity(0))
    assert results["machine"]["cores_usable"] == cores
    assert out.startswith(results["machine"]["summary"])
    assert len(results["machine"]["load_average_end"]) == 3


def test_loop_memory_is_extrapolated(monkeypatch):
    # Past `MAX_LOOP_LENGTH` the loop is not compiled at the point's length: its
    # temp memory is the line through two shorter loops.
    monkeypatch.setattr(_grid, "MAX_LOOP_LENGTH", 4)

    def loop_temp(steps):
        model, loss, inputs, with_options = _grid._problem("gru", (4, steps))
        return _grid.compile_step(loss, with_options(model, mode="loop"), inputs)[0]

    extrapolated = _grid.loop_temp_extrapolated("gru", (4, 6))
    assert extrapolated["lengths"] == [2, 4]
    assert extrapolated["bytes"] == [loop_temp(2), loop_temp(4)]
    actual = loop_temp(6)
    assert abs(extrapolated["estimate"] - actual) <= 0.02 * actual


def _point(times, confirm, temp, twin=None, extrapolated=None):
    return {
        "kind": "gru",
        "size": [4, 100],
        "times": times,
        "rounds": 3,
        "confirm": {"best": None, "rounds": 3, "times": confirm},
        "temp_bytes": temp,
        "loop_temp_extrapolated": extrapolated,
        "choice": {"saved_bytes": 10 * 2**20, "label": "remat/u1"},
        "twin": twin,
        "loop_program": False,
    }


TIMES = {
    "loop": [1.0, 1.0, 1.0],
    "default": [1.0, 1.0, 1.0],
    "a": [0.95, 0.95, 0.95],
    "b": [0.9, 0.9, 0.9],
    "c": [0.5, 0.5, 0.5],  # fastest, but over the memory rule
}
CONFIRM = {"loop": [1.0, 1.1, 0.9], "default": [1.0, 1.1, 0.9], "b": [1.0] * 3}
TEMP = {"loop": 100, "default": 50, "a": 100, "b": 90, "c": 101}


def test_summary_confirms_the_best_in_fresh_rounds():
    # "b" wins the first rounds by luck; timed again, it is no faster than the
    # default. The reported ratio is the confirming rounds', not the lucky one.
    s = _grid.summarise(_point(TIMES, CONFIRM, TEMP))
    assert s["best"] == "b"
    assert s["selection"]["default_vs_best"] == pytest.approx(1 / 0.9)
    assert s["default_vs_best"] == pytest.approx(1.0)
    assert s["best_vs_loop"] == pytest.approx(np.median([1.0, 1 / 1.1, 1 / 0.9]))
    assert s["loop_ms"] == pytest.approx(1e3)
    # Small residuals allow 1.25x the loop's temp memory: then "c" is allowed.
    small = _point(TIMES, CONFIRM | {"c": [0.6] * 3}, TEMP)
    small["choice"]["saved_bytes"] = 2**20
    s = _grid.summarise(small)
    assert s["best"] == "c"
    assert s["default_vs_best"] == pytest.approx(np.median([1 / 0.6, 1.1 / 0.6, 1.5]))
    # Where the best lowers to the default's own program, the default is the best.
    s = _grid.summarise(_point(TIMES, CONFIRM, TEMP, twin="b"))
    assert s["default_vs_best"] == 1.0


def test_long_point_is_judged_against_the_extrapolated_loop():
    # Without a loop, the plain scan stands in for the loop's step time only; the
    # memory rule and the table use the loop's extrapolated memory.
    times = {k: v for k, v in TIMES.items() if k != "loop"}
    times[_grid.REF] = [1.0, 1.0, 1.0]
    confirm = {"default": [1.0] * 3, _grid.REF: [1.0] * 3, "b": [1.0] * 3}
    temp = {k: v for k, v in TEMP.items() if k != "loop"} | {_grid.REF: 400}
    extrapolated = {"lengths": [32, 64], "bytes": [60, 80], "estimate": 95}
    point = _point(times, confirm, temp, extrapolated=extrapolated)
    point["summary"] = s = _grid.summarise(point)
    assert s["reference"] == _grid.REF
    assert s["default_mem_vs_loop"] == 50 / 95
    assert s["best"] == "b"  # 90 bytes: within the loop's 95, unlike "a" and "c"
    row = _grid._row(point)
    assert row.startswith("| GRU H=4 T=100* |")
    assert f"| {95 / 2**20:.2f} | 3 + 3 |" in row
