"""`eqxscan.planning.plan`'s predictions on 2 processes x 4 CPU devices (127.0.0.1).

Runs tests/scripts/plan_checks.py as one process with 8 devices (which also trains
on one device for reference) and as a 2 x 4 job, and prints, per process, the
bytes the plan predicts per device against the bytes of the arrays live on each of
its devices, and the losses of three training steps against one device's.

    PYTHONPATH=. python benchmarks/plan_two_processes.py
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "plan_checks.py"
TIMEOUT = 600


def env() -> dict[str, str]:
    out = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    out.pop("XLA_FLAGS", None)
    out["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), out.get("PYTHONPATH")) if p
    )
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def main() -> None:
    one = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        env=env(),
        timeout=TIMEOUT,
        check=True,
    )
    single = last_json(one.stdout)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                "two",
                "--process-id",
                str(i),
                "--port",
                port,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        for i in range(2)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
            if p.returncode != 0:
                raise SystemExit(f"a process of the 2 x 4 job failed:\n{err[-3000:]}")
            results.append(last_json(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(
        "| process | chosen mesh | predicted bytes per device | live bytes per device |"
    )
    print("|---:|---|---:|---|")
    for r in results:
        live = ", ".join(f"{v:,}" for v in r["live"].values())
        print(
            f"| {r['process']} | {tuple(r['chosen'])} | {r['state_bytes']:,} | {live} |"
        )
    print()
    print("| run | losses |")
    print("|---|---|")
    print(f"| one device | {', '.join(f'{x:.6f}' for x in single['reference'])} |")
    print(f"| 1 process x 8 | {', '.join(f'{x:.6f}' for x in single['losses'])} |")
    for r in results:
        print(
            f"| 2 x 4, process {r['process']} | "
            f"{', '.join(f'{x:.6f}' for x in r['losses'])} |"
        )


if __name__ == "__main__":
    main()
