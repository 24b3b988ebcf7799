"""``leto bench control``, runnable from a checkout: ``python benchmarks/control.py [options]``."""

import sys

from leto.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "control", *sys.argv[1:]]))
