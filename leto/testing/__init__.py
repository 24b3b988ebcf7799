"""Reusable test machinery: Hypothesis state machines that any backend can run.

``leto.testing.cluster.ClusterMachine`` drives the protocol with random steps and
random faults at random phases, checks every invariant after every rule, and compares
each recovery with an independent plain model. A backend subclasses it and overrides
``execute`` to carry out each step's effects on real state (see zarr's
``zarr.testing.stateful`` for the pattern).
"""
