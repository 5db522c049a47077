"""Steps that change a trained model after ``jem train``'s loop, each kept only on evidence.

The temperature is chosen here; the BatchNorm statistics recomputed from the data are the
library's :class:`~jem_plugin.extensions.RecomputeBatchNorm`, which ``fit`` runs. Every step is measured on the held-out split before and after, and kept only when the
held-out data show it is not worse; otherwise the model is put back as it was. What was decided,
with the numbers, is returned as a :class:`Decision` for the console and ``metrics.json``.
Without a held-out split nothing is changed: there is no evidence to keep a change on.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .. import calibration
from ..extensions import Decision

# The BatchNorm recompute is the library's (jem_plugin.extensions.RecomputeBatchNorm, run by fit).
__all__ = [
    "SMALL_HELD_OUT",
    "TITLES",
    "Decision",
    "title",
    "choose_temperature",
    "small_held_out_warning",
    "near_chance_warning",
]

# Below this many held-out images, a difference of one or two images decides: say so.
SMALL_HELD_OUT = 200


#: Each step's title, for the console and the report.
TITLES = {
    "bn_stats_from_data": "BatchNorm running statistics recomputed from the training data",
    "temperature": "a temperature on the logits",
}


def title(decision: Decision) -> str:
    """What the step does, for the console."""
    return TITLES.get(decision.step, decision.step)


def small_held_out_warning(n: int) -> str | None:
    """One line when ``n`` held-out images are too few to decide on, else ``None``."""
    if 0 < n < SMALL_HELD_OUT:
        return (
            f"the held-out split has {n} images (under {SMALL_HELD_OUT}): one image is "
            f"{100 / n:.1f} points of accuracy, too few to tell a better model from a worse one; "
            "give --val-data or a larger --val-fraction"
        )
    return None


def near_chance_warning(
    held_out_accuracy: float,
    train_accuracy: float | None,
    held_out_labels: Tensor,
    *,
    batchnorm: bool,
    recomputed: Decision | None,
    iterations: int,
) -> str | None:
    """One line when held-out accuracy is near chance while training accuracy is high, naming the
    likely cause and the fix; else ``None``.

    Chance is what predicting the commonest held-out class scores. "Near": within a tenth of the
    way from chance to 1; "high": at least 0.5 above the held-out accuracy. On a short run a
    BatchNorm network classifies its training batches (batch statistics) and fails on the
    held-out split (running statistics still far from the trained network's), which the step
    ``recomputed`` (:func:`~jem_plugin.extensions.recompute_batchnorm`) repairs.
    """
    if train_accuracy is None or len(held_out_labels) == 0:
        return None
    chance = float(held_out_labels.bincount().max()) / len(held_out_labels)
    if held_out_accuracy > chance + 0.1 * (1 - chance) or train_accuracy < held_out_accuracy + 0.5:
        return None
    head = (
        f"held-out accuracy {held_out_accuracy:.3f} is near chance ({chance:.3f}, the commonest class's share) "
        f"while training accuracy is {train_accuracy:.3f}"
    )
    if batchnorm and recomputed is None:
        return (
            f"{head}. Likely cause: BatchNorm running statistics that lag a short run ({iterations} iterations; "
            "training normalises each batch by its own statistics, evaluation by running averages still far "
            "from the trained network's). Fix: --bn-stats-from-data (recomputes them from the training data after "
            "training, kept only if held-out accuracy is not lower), or more --epochs"
        )
    cause = (
        f"its BatchNorm statistics were recomputed from the training data ({recomputed.reason}), so they are "
        "not the cause"
        if batchnorm and recomputed is not None
        else "the network has no BatchNorm layer, so lagging statistics are not the cause"
    )
    return (
        f"{head}: {cause}. The held-out images may differ from the training images (their size, colours or "
        "labels: check --val-data), or the model memorised the training set (more images, fewer --epochs)"
    )


def choose_temperature(logits: Tensor, labels: Tensor) -> tuple[Decision, dict[str, Any]]:
    """A temperature for the model's logits, kept only if it lowers the held-out ECE.

    The ECE after the temperature is cross-fitted (each half of the held-out split scaled by a
    temperature fitted on the other half: :func:`jem_plugin.calibration.cross_fitted_report`), so
    the split that judges a temperature never chose it. Returns the decision and the report; the
    candidate is the geometric mean of the two halves' temperatures.

    ``report["temperature_fitted"]`` says what ``jem eval`` says of the same split
    (:func:`jem_plugin.calibration.calibration_report`): a temperature is fitted wherever the split
    has a misclassified image. Where only one half has one, no half can judge a temperature: the
    one fitted on the whole split is the candidate (``temperature_cross_fitted`` false), never kept.
    ``report["temperature_candidate"]`` is the temperature fitted and judged (``None`` where none
    fits); ``report["temperature"]`` the one ``model.pt`` keeps (``None`` where it keeps none, as
    ``jem eval`` reports it); ``report["temperature_kept"]`` the decision; ``report["ece_saved"]``
    the ECE on the whole split of the model as saved (its logits divided by the kept temperature,
    else as they are): what ``jem eval`` reports as ``"ece"`` on this split.
    """
    report: dict[str, Any] = dict(calibration.cross_fitted_report(logits, labels))
    report["temperature_cross_fitted"] = bool(report["temperature_fitted"])
    keep = bool(report["temperature_fitted"]) and report["ece_after"] < report["ece_before"]
    if report["temperature_fitted"]:
        verdict = "kept" if keep else "not kept: it does not lower the held-out ECE"
        reason = (
            f"{verdict} (ECE {report['ece_before']:.3f} -> {report['ece_after']:.3f} on halves it was not fitted on)"
        )
    else:
        whole = calibration.calibration_report(logits, labels)  # what jem eval fits on this split
        if whole["temperature_fitted"]:
            report["temperature"], report["temperature_fitted"] = whole["temperature"], True
            reason = (
                f"not kept: {whole['temperature']:.2f} fits the whole held-out split (jem eval fits the same), but a "
                "half of it has no misclassified image, so no half it was not fitted on can show that it helps; "
                "a larger held-out split can tell"
            )
        else:
            reason = (
                "not fitted: the held-out split has no misclassified image, so no temperature minimises its NLL "
                "(it keeps falling as the temperature goes to 0); a larger held-out split can tell"
            )
    report["temperature_kept"] = keep
    # "temperature" is the model's, as jem eval reports it (None where model.pt keeps none); the one
    # fitted and judged is the candidate, whether kept or not
    report["temperature_candidate"] = report["temperature"] if report["temperature_fitted"] else None
    report["temperature"] = report["temperature_candidate"] if keep else None
    # The model as saved, on this split: what `jem eval` reports as its "ece" (the model file's temperature)
    saved = logits / report["temperature"] if keep else logits
    report["ece_saved"] = calibration.ece(saved, labels, from_logits=True)
    return Decision("temperature", keep, reason, report["ece_before"], report["ece_after"], int(report["n"])), report
