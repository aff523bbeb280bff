import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def run_example(name, *args, timeout=600):
    """Run `examples/<name>` in a fresh process; the repo root is importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_stacked_mlp_example_learns():
    stdout = run_example("stacked_mlp.py", "--tiny")
    baseline = float(re.search(r"baseline .*MSE: ([0-9.]+)", stdout).group(1))
    final = float(re.search(r"final val MSE: ([0-9.]+)", stdout).group(1))
    assert final < 0.7 * baseline
    assert re.search(r"scan/loop: compile [0-9.]+x, step [0-9.]+x", stdout)
