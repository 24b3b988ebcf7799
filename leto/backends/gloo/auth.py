"""The job's secret, and the proof of it every TCP peer of the coordinator gives.

Node 0's agent listens on TCP for the other nodes' agents. Anyone who can reach
that port can connect, so a connection counts as a node only once it has proven
that it holds the job's secret, and the node checks the same of the coordinator
before it obeys it (an HMAC challenge and response both ways; the secret itself
never crosses the wire):

1. the coordinator sends ``{"t": "challenge", "nonce": Ns}`` as soon as it accepts;
2. the node answers ``{"t": "node_hello", "node": n, "nonce": Nc, "proof":
   HMAC(secret, "node", n, Ns, Nc)}``; the coordinator compares it with
   :func:`hmac.compare_digest` and closes the connection unless it matches;
3. the coordinator's ``welcome`` carries ``HMAC(secret, "coordinator", n, Ns,
   Nc)``, which the node checks the same way.

Each side's nonce is fresh, so a recorded exchange proves nothing later, and the
two roles are part of what is signed, so neither side's proof can be replayed as
the other's.

A spare agent (``leto launch --spare``) has no node rank when it joins: it answers
the same challenge with ``{"t": "spare_hello", "nonce": Nc, "proof": HMAC(secret,
"spare", POOL, Ns, Nc)}``, and the coordinator's ``pooled`` carries ``HMAC(secret,
"pool", spare_id, Ns, Nc)``: two more roles, so no proof of a node or of a spare
serves as another's.

Where the secret comes from, never from a command line:

* ``LETO_JOB_SECRET`` in the environment, if set (the same value on every node,
  for example from the scheduler); the agent removes it from its environment, so
  its keepers and trainers do not inherit it;
* otherwise node 0 generates one (``secrets.token_bytes``) and writes it to
  ``RUN_DIR/secret`` (mode 0600, in a 0700 run directory); another node reads
  it from its own run directory, which is node 0's when the nodes share it (one
  machine, or a shared file system: the tests, :func:`~.harness.run_local`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from leto.private import InsecurePathError, check_private_file

__all__ = [
    "ENV",
    "FILE",
    "MIN_BYTES",
    "POOL",
    "SecretError",
    "from_environment",
    "new_nonce",
    "proof",
    "new_secret",
    "read_secret",
    "verify",
    "write_secret",
]

ENV = "LETO_JOB_SECRET"
FILE = "secret"
MIN_BYTES = 16
POOL = -1  # the node a pooled spare's proof names: it has no node rank yet
_LABEL = b"leto-link-v1"


class SecretError(RuntimeError):
    """The job's secret cannot be found or is not safe to use (a one-line reason)."""


def new_secret() -> bytes:
    """A fresh secret: 32 random bytes, as 64 hex characters (the form stored)."""
    return secrets.token_bytes(32).hex().encode()


def write_secret(run_dir: str | os.PathLike[str], secret: bytes) -> Path:
    """Write ``secret`` to ``run_dir/secret``, mode 0600, replacing any earlier one
    atomically (a reader sees the old file or the new one, never a part)."""
    path = Path(run_dir) / FILE
    tmp = path.with_name(f".{FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secret + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_secret(run_dir: str | os.PathLike[str]) -> bytes | None:
    """The secret in ``run_dir/secret``; None if there is none. :class:`SecretError`
    if the file is not ours, or can be read or written by another user."""
    path = Path(run_dir) / FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SecretError(f"cannot read the job secret {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        try:
            check_private_file(path, st, "the job secret")
        except InsecurePathError as e:
            raise SecretError(str(e)) from None
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            raise SecretError(f"the job secret {path} is not a small regular file")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < MIN_BYTES:
        raise SecretError(f"the job secret {path} is shorter than {MIN_BYTES} bytes")
    return data


def from_environment() -> bytes | None:
    """The secret in ``LETO_JOB_SECRET``, if set, taken out of the environment (so
    that the processes this one starts do not inherit it)."""
    env = os.environ.pop(ENV, None)
    if env is None:
        return None
    got = env.strip().encode()
    if len(got) < MIN_BYTES:
        raise SecretError(f"{ENV} is shorter than {MIN_BYTES} bytes")
    return got


def new_nonce() -> str:
    return secrets.token_hex(16)


def proof(secret: bytes, role: str, node: int, challenge: str, nonce: str) -> str:
    """What ``role`` ("node", "coordinator", "spare" or "pool") sends to prove it holds
    ``secret``."""
    text = b"\0".join(
        [_LABEL, role.encode(), str(node).encode(), challenge.encode(), nonce.encode()]
    )
    return hmac.new(secret, text, hashlib.sha256).hexdigest()


def verify(
    secret: bytes, role: str, node: int, challenge: str, nonce: object, given: object
) -> bool:
    """Whether ``given`` is ``role``'s proof over the peer's ``nonce`` (compared in
    constant time); False for anything that is not a string."""
    if not isinstance(given, str) or not isinstance(nonce, str) or len(nonce) > 256:
        return False
    want = proof(secret, role, node, challenge, nonce)
    return hmac.compare_digest(want.encode(), given.encode("utf-8", "replace"))
