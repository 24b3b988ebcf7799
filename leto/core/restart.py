"""Whether a job that in-place recovery cannot continue starts again (``--max-restarts``).

Theory of operation: in-place recovery is the first resort and the disk checkpoint
inside it the last tier (``GoFallback``). What ends a job is one of a few
:class:`Ending` kinds, and only one of them is worth starting the whole job again:

* ``GAVE_UP``: a recovery could not continue (its deadline passed, a lost node had no
  replacement within the spare timeout, more recoveries than allowed). The hardware
  or the cluster failed leto, not the script: a restart from the latest disk
  checkpoint, on the nodes there are then, may well succeed;
* ``SCRIPT_ERROR``: the script raised the same exception at the same step in several
  incarnations in a row: a restart would repeat it, and spend the restarts for nothing;
* ``FATAL``: everything else (a failure before training started, an event the model
  refused, ranks that disagree on their config, a commit record that cannot be
  written): a bug or bad input, never hidden behind a restart.

:func:`after` decides: a ``GAVE_UP`` ending restarts while fewer than ``max_restarts``
restarts were made (torchrun's ``--max-restarts``); anything else stops the job.
A restart resumes every rank from the latest checkpoint of the config's
``checkpoint_dir``, which is why :func:`refusal` stops a job that asks for restarts
with no ``checkpoint_dir`` at its start: its restart would begin again at step 0 (a job
that wants exactly that sets ``checkpoint_dir`` and no interval: the start's checkpoint
of step 0 is then the one a restart takes). Pure: no IO, no clock.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ["Ending", "Restart", "after", "refusal"]


class Ending(enum.Enum):
    GAVE_UP = "gave_up"
    SCRIPT_ERROR = "script_error"
    FATAL = "fatal"


@attrs.frozen
class Restart:
    """Start the whole job again, as restart number ``attempt`` of ``of`` (from 1), in
    the world it had (a world change is carried out in place: :mod:`leto.core.reshape`)."""

    attempt: int
    of: int

    def __attrs_post_init__(self) -> None:
        if not all(type(v) is int for v in (self.attempt, self.of)):
            raise ValueError(f"a restart's attempt and of are ints, got {self!r}")
        if not 1 <= self.attempt <= self.of:
            raise ValueError(f"restart {self.attempt} of {self.of} is not in 1..{self.of}")


def after(ending: Ending, restarts: int, max_restarts: int) -> Restart | None:
    """The restart a job that ended with ``ending`` makes, having made ``restarts`` of
    ``max_restarts`` already; None: the job stops."""
    if restarts < 0 or max_restarts < 0:
        raise ValueError(f"restarts {restarts} and max_restarts {max_restarts} must be >= 0")
    if ending is not Ending.GAVE_UP or restarts >= max_restarts:
        return None
    return Restart(restarts + 1, max_restarts)


def refusal(max_restarts: int, checkpoint: bool) -> str | None:
    """Why a job asking for ``max_restarts`` restarts cannot start, or None: a restart
    resumes from the disk checkpoint, so it needs one configured."""
    if max_restarts > 0 and not checkpoint:
        return (
            f"--max-restarts {max_restarts}: a restart resumes every rank from the latest "
            "checkpoint of the leto config's checkpoint_dir, and the script's config sets "
            "none; set checkpoint_dir (with no checkpoint_interval a restart starts again "
            "from the checkpoint of step 0 written at the start)"
        )
    return None
