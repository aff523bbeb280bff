"""The child process of a plan: `python -m eqxscan.planning SPEC OUT`."""

import sys

from ._child import main


main(sys.argv[1:])
