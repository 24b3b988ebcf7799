"""The step every rank ends an interrupted retained step at.

After a failure the survivors (and the replacements that took the dead ranks'
coordinates) each report their retained step: the step their chunks are committed at and
the step whose gradients they sealed last. :func:`agree_step` is the rule that turns the
reports into one step for all: a pure protocol rule, so it lives in the core; the FSDP2 /
tensor-parallel path (:mod:`leto.retained.regroup`) applies it after regrouping.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from leto.core.errors import StepAgreementError

__all__ = ["StepAgreementError", "StepReport", "agree_step"]


def _check_step(inst: StepReport, attribute: attrs.Attribute[int], value: int) -> None:
    least = 0 if attribute.name == "version" else -1  # prepared -1: nothing sealed yet
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise StepAgreementError(
            f"StepReport.{attribute.name} must be an int >= {least}, got {value!r}"
        )


@attrs.frozen
class StepReport:
    """One rank's retained step after a failure: the step its chunks are committed at
    (``version``) and the step whose gradients it sealed last (``prepared``, -1: none)."""

    version: int = attrs.field(validator=_check_step)
    prepared: int = attrs.field(validator=_check_step)


def agree_step(reports: Sequence[StepReport]) -> int:
    """The step every rank ends at, ``v`` being the highest committed step: ``v`` when a
    rank is behind at ``v - 1`` (it rolls forward, its gradients of ``v`` sealed); ``v + 1``
    when every rank is at ``v`` and sealed the gradients of ``v + 1`` (all roll forward);
    else ``v`` (each rank rolls back what it prepared beyond).

    A rank begins applying a step only once every rank sealed its gradients (the
    caller's vote), so a rank behind another always has them sealed; anything else is
    refused with :class:`StepAgreementError`."""
    if not reports:
        raise StepAgreementError("no rank reported its step")
    top = max(r.version for r in reports)
    behind = [r for r in reports if r.version < top]
    if any(r.version < top - 1 or r.prepared != top for r in behind):
        raise StepAgreementError(
            f"ranks at steps {sorted({r.version for r in reports})} cannot agree: "
            f"a rank behind step {top} has not sealed its gradients"
        )
    if behind:
        return top
    if all(r.prepared == top + 1 for r in reports):
        return top + 1
    return top
