"""The failure model: what fails, how often, and what each failure destroys.

Two public sources, both shipped or quoted in ``leto/data/``:

* **Mix.** The Llama 3 interruption table ("The Llama 3 Herd of Models", Table 5):
  419 unexpected interruptions in 54 days on 16,384 H100 GPUs, by root-cause
  category (``leto/data/llama3_interruptions.csv``). Counts are trusted, not the
  printed shares (the first row's printed share is inconsistent with its count).
* **Rate vs scale.** Meta, "Revisiting Reliability in Large-Scale ML Research
  Clusters" (HPCA'25) projects a job's mean time to failure of 7.9 h at 1,024
  GPUs, 1.8 h at 16,384 and about 14 min at 131,072. The simulator interpolates
  these points in log-log space (extrapolating with the end slopes). By default
  the *level* comes from Llama 3 (419 failures / 54 days = 3.09 h at 16,384 GPUs,
  the one large job whose count and mix are both published) and the *shape* from
  Meta; ``calibration="meta"`` uses Meta's absolute figures instead.

Each category is put in one of four classes by what the failure destroys, which is
what decides how each strategy recovers. The default classing and its reasons are
in :data:`DEFAULT_CLASS`; the fraction of in-place-recoverable failures can then be
overridden, which rescales the other three classes in their published proportions.
"""

from __future__ import annotations

import csv
import enum
import math
from collections.abc import Mapping
from importlib import resources

import attrs


class FailureClass(enum.IntEnum):
    """What a failure destroys; the index is the class's code in a trace."""

    IN_PLACE = 0  # the process dies or hangs; every byte of memory and all hardware survive
    DEVICE_MEMORY = 1  # one GPU's memory is lost (GPU reset); the node and its host memory survive
    NODE_LOSS = 2  # the node's memory is lost (reboot); the node comes back after a reboot
    REPLACEMENT = 3  # hardware must be replaced: the node leaves for repair; a spare must take it


# Why each Llama 3 category goes where it goes.
DEFAULT_CLASS: Mapping[str, FailureClass] = {
    # Hardware fault in the GPU or NVLink; the GPU is drained and swapped (Crusoe's fleet:
    # GPU host replacement is 41.5% of failures, close to this class's 43% share here).
    "Faulty GPU (incl. NVLink)": FailureClass.REPLACEMENT,
    # Uncorrectable ECC / row remapping and GSP faults need a GPU reset (NVIDIA Xid
    # catalogue: "reset GPU"), which clears the GPU's memory but leaves the node up.
    "GPU HBM3 memory": FailureClass.DEVICE_MEMORY,
    "GPU SRAM memory": FailureClass.DEVICE_MEMORY,
    "GPU system processor": FailureClass.DEVICE_MEMORY,
    # The process fails; nothing in the hardware needs a reset: recoverable in place.
    "Software bug": FailureClass.IN_PLACE,
    "Dependency": FailureClass.IN_PLACE,
    "NCCL watchdog timeout": FailureClass.IN_PLACE,
    # A switch or cable takes the job down, but no node's memory is touched and the fabric
    # routes around the failed part; the job can resume on the same nodes in place.
    "Network switch or cable": FailureClass.IN_PLACE,
    # Unplanned maintenance reboots the host: its memory is gone, the node comes back.
    "Host maintenance": FailureClass.NODE_LOSS,
    # Host components: the node leaves for repair.
    "NIC": FailureClass.REPLACEMENT,
    "SSD": FailureClass.REPLACEMENT,
    "Power supply": FailureClass.REPLACEMENT,
    "Server chassis": FailureClass.REPLACEMENT,
    "IO expansion board": FailureClass.REPLACEMENT,
    "CPU": FailureClass.REPLACEMENT,
    "System memory": FailureClass.REPLACEMENT,
    # A GPU that silently corrupts data, or overheats, is taken out of service.
    "Silent data corruption": FailureClass.REPLACEMENT,
    "GPU thermal interface or sensor": FailureClass.REPLACEMENT,
}

LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
LLAMA3_UNEXPECTED = 419
# Meta HPCA'25 projected job MTTF (hours) by GPU count.
META_MTTF_H: tuple[tuple[int, float], ...] = ((1_024, 7.9), (16_384, 1.8), (131_072, 14.0 / 60.0))

CALIBRATIONS = ("llama3", "meta")


@attrs.frozen
class Category:
    name: str
    component: str
    count: int
    cls: FailureClass


def load_categories(classing: Mapping[str, FailureClass] | None = None) -> tuple[Category, ...]:
    """The Llama 3 table, each row classed (by ``classing``, else :data:`DEFAULT_CLASS`)."""
    classing = DEFAULT_CLASS if classing is None else classing
    text = resources.files("leto").joinpath("data/llama3_interruptions.csv").read_text()
    rows = list(csv.DictReader(text.splitlines()))
    cats = []
    for row in rows:
        name = row["category"]
        if name not in classing:
            raise ValueError(f"failure category {name!r} has no class")
        cats.append(Category(name, row["component"], int(row["interruptions"]), classing[name]))
    return tuple(cats)


def class_shares(categories: tuple[Category, ...]) -> tuple[float, float, float, float]:
    """The fraction of failures in each :class:`FailureClass`, in class order."""
    total = sum(c.count for c in categories)
    shares = [0.0] * len(FailureClass)
    for c in categories:
        shares[c.cls] += c.count / total
    return (shares[0], shares[1], shares[2], shares[3])


def with_hof_fraction(
    shares: tuple[float, float, float, float], hof: float
) -> tuple[float, float, float, float]:
    """Set the in-place share to ``hof``; the other classes keep their relative mix."""
    if not 0.0 <= hof <= 1.0 or math.isnan(hof):
        raise ValueError(f"HOF fraction must be in [0, 1], got {hof}")
    rest = 1.0 - shares[0]
    if rest <= 0.0:
        raise ValueError("every category is in place: no mix to rescale")
    k = (1.0 - hof) / rest
    return (hof, shares[1] * k, shares[2] * k, shares[3] * k)


def meta_mttf_hours(gpus: int) -> float:
    """Meta's projected job MTTF, interpolated in log-log space through its three points."""
    if gpus <= 0:
        raise ValueError(f"GPU count must be positive, got {gpus}")
    pts = META_MTTF_H
    if gpus <= pts[0][0]:
        (n0, m0), (n1, m1) = pts[0], pts[1]
    elif gpus >= pts[-1][0]:
        (n0, m0), (n1, m1) = pts[-2], pts[-1]
    else:
        i = next(i for i in range(len(pts) - 1) if pts[i][0] <= gpus <= pts[i + 1][0])
        (n0, m0), (n1, m1) = pts[i], pts[i + 1]
    slope = math.log(m1 / m0) / math.log(n1 / n0)
    return m0 * math.exp(slope * math.log(gpus / n0))


def llama3_mtbf_hours() -> float:
    """The Llama 3 job's mean time between unexpected interruptions: 3.09 h."""
    return LLAMA3_DAYS * 24.0 / LLAMA3_UNEXPECTED


def job_mtbf_hours(gpus: int, calibration: str = "llama3") -> float:
    """A job's mean time between failures on ``gpus`` GPUs under a named calibration."""
    if calibration == "meta":
        return meta_mttf_hours(gpus)
    if calibration == "llama3":
        return llama3_mtbf_hours() * meta_mttf_hours(gpus) / meta_mttf_hours(LLAMA3_GPUS)
    raise ValueError(f"unknown calibration {calibration!r}; choose from {', '.join(CALIBRATIONS)}")
