"""``leto bench tier2``, runnable from a checkout: ``python benchmarks/tier2.py [options]``."""

import sys

from leto.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "tier2", *sys.argv[1:]]))
