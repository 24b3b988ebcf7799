"""A script that never calls leto.wrap (a plain torchrun script)."""

print("hello from a plain script")
