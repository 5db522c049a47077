"""Steps that change a trained model after ``jem train``'s loop, each kept only on evidence.

Every step here is measured on the held-out split before and after, and kept only when the
held-out data show it is not worse; otherwise the model is put back as it was. What was decided,
with the numbers, is returned as a :class:`Decision` for the console and ``metrics.json``.
Without a held-out split nothing is changed: there is no evidence to keep a change on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.swa_utils import update_bn

from .. import calibration
from .. import distributed as jdist

__all__ = ["SMALL_HELD_OUT", "Decision", "recompute_batchnorm", "choose_temperature", "small_held_out_warning"]

# Below this many held-out images, a difference of one or two images decides: say so.
SMALL_HELD_OUT = 200


@dataclass(frozen=True)
class Decision:
    """One post-training step: whether it was kept, why, and the held-out numbers behind it."""

    step: str
    kept: bool
    reason: str
    before: float | None = None
    after: float | None = None
    n_heldout: int = 0

    @property
    def title(self) -> str:
        """What the step does, for the console."""
        return _TITLES.get(self.step, self.step)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_TITLES = {
    "bn_stats_from_data": "BatchNorm running statistics recomputed from the training data",
    "temperature": "a temperature on the logits",
}


def small_held_out_warning(n: int) -> str | None:
    """One line when ``n`` held-out images are too few to decide on, else ``None``."""
    if 0 < n < SMALL_HELD_OUT:
        return (
            f"the held-out split has {n} images (under {SMALL_HELD_OUT}): one image is "
            f"{100 / n:.1f} points of accuracy, too few to tell a better model from a worse one; "
            "give --val-data or a larger --val-fraction"
        )
    return None


def _accuracy_nll(logits: Tensor, labels: Tensor) -> tuple[float, float]:
    return float((logits.argmax(1) == labels).float().mean()), float(F.cross_entropy(logits, labels))


def _agree(value: bool) -> bool:
    """Rank 0's decision on every rank (only rank 0 scores the held-out split)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def recompute_batchnorm(
    jm: nn.Module,
    loader: Any,
    held_out_logits: Callable[[], tuple[Tensor, Tensor]] | None,
    device: torch.device,
) -> Decision | None:
    """Recompute the BatchNorm running statistics of ``jm`` from ``loader`` (the training data)
    and keep them only if held-out accuracy is not lower (ties broken by held-out NLL).

    ``held_out_logits`` returns ``(logits, labels)`` of the held-out split, on rank 0 only
    (``None`` elsewhere and when there is no held-out split). Returns ``None`` for a model
    without BatchNorm.
    """
    norms = [m for m in jm.modules() if isinstance(m, _BatchNorm)]
    if not norms:
        return None
    if held_out_logits is None and jdist.is_main_process():
        return Decision(
            "bn_stats_from_data",
            False,
            "not recomputed: without a held-out split nothing shows the recomputed statistics are not worse",
        )
    saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in norms]
    before = _accuracy_nll(*held_out_logits()) if held_out_logits is not None else None
    update_bn(loader, jm, device=device)
    jdist.average_batchnorm_statistics(jm)  # each rank saw its own shard
    labels_n, after = 0, None
    if held_out_logits is not None:
        logits, labels = held_out_logits()
        labels_n, after = len(labels), _accuracy_nll(logits, labels)
    keep = _agree(after is not None and before is not None and (after[0], -after[1]) >= (before[0], -before[1]))
    if not keep:
        for m, state in zip(norms, saved):
            m.load_state_dict(state)
    if before is None or after is None:  # a rank other than 0: rank 0 reports
        return Decision("bn_stats_from_data", keep, "decided on rank 0")
    verdict = "kept: held-out accuracy is not lower" if keep else "discarded: held-out accuracy is lower with them"
    if before[0] == after[0]:
        verdict += f" (equal; held-out NLL {before[1]:.3f} -> {after[1]:.3f})"
    return Decision("bn_stats_from_data", keep, verdict, before[0], after[0], labels_n)


def choose_temperature(logits: Tensor, labels: Tensor) -> tuple[Decision, dict[str, float]]:
    """A temperature for the model's logits, kept only if it lowers the held-out ECE.

    The ECE after the temperature is cross-fitted (each half of the held-out split scaled by a
    temperature fitted on the other half: :func:`jem_plugin.calibration.cross_fitted_report`), so
    the split that judges a temperature never chose it. Returns the decision and the report; the
    kept temperature is ``report["temperature"]``, the geometric mean of the two halves' ones.
    """
    report = calibration.cross_fitted_report(logits, labels)
    keep = report["ece_after"] < report["ece_before"]
    reason = (
        f"kept: ECE {report['ece_before']:.3f} -> {report['ece_after']:.3f} on held-out halves it was not fitted on"
        if keep
        else f"not kept: it does not lower the held-out ECE ({report['ece_before']:.3f} -> {report['ece_after']:.3f})"
    )
    return Decision("temperature", keep, reason, report["ece_before"], report["ece_after"], int(report["n"])), report
