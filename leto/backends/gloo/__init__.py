"""The gloo backend: real processes on CPU, retained state in memfd shared memory.

Pieces (each module's docstring says more; ``docs/gloo.md`` is the overview):

* :mod:`.wire`: length-prefixed JSON messages, file descriptors via ``SCM_RIGHTS``;
* :mod:`.segments`: anonymous memfd segments mapped as tensors;
* :mod:`.keeper` / :mod:`.keeper_client`: the per-rank process owning retained
  memory, with generation fencing;
* :mod:`.procs`: process handles (pidfd), parent-death signals, memory use.
* :mod:`.memory_provider` / :mod:`.cuda_memory`: one interface for a keeper's memory,
  host memfd or CUDA IPC (not yet used by the keeper; ``docs/gpu.md``).

Importing this package imports no torch.
"""
