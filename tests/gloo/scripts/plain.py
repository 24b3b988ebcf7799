"""A script that never calls leto.wrap (a plain torchrun script); SLEEP: seconds it
then runs on, making no collective."""

import os
import time

print("hello from a plain script")
time.sleep(float(os.environ.get("SLEEP", "0")))
