"""``leto bench scaling``, runnable from a checkout: ``python benchmarks/scaling.py [options]``."""

import sys

from leto.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "scaling", *sys.argv[1:]]))
