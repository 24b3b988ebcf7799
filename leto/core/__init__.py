"""The protocol core: pure, deterministic, sans-IO state machines.

No torch, no IO, no clock, no randomness: time comes in as an argument, effects go out
as values for a backend to carry out. ``spec/Leto.tla`` is the same protocol in TLA+;
``spec/PROTOCOL.md`` is the contract between the two.
"""

from leto.core.cluster import ClusterConfig, ClusterModel, ClusterState, Mutant
from leto.core.errors import ProtocolError

__all__ = ["ClusterConfig", "ClusterModel", "ClusterState", "Mutant", "ProtocolError"]
