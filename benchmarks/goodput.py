"""``leto bench goodput``, runnable from a checkout: ``python benchmarks/goodput.py [options]``."""

import sys

from leto.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "goodput", *sys.argv[1:]]))
