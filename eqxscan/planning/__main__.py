"""The child process of a plan: `python -m eqxscan.planning SPEC OUT`."""

import sys

from ._child import main


if len(sys.argv) != 3 or sys.argv[1].startswith("-"):
    sys.exit(
        "usage: python -m eqxscan.planning SPEC OUT\nThe process "
        "eqxscan.planning.plan starts to compile candidates on simulated devices; "
        "call plan(...) instead."
    )
main(sys.argv[1:])
