"""Post-hoc out-of-distribution scoring and evaluation for any wrapped classifier.

Convention, used by every score and metric here: **higher score = more in-distribution**.
(pytorch-ood returns *outlier* scores, higher = more OOD; ours are their negatives.)

>>> import jem_plugin as jem
>>> jm = jem.wrap(model)
>>> s_in = jem.ood.score(jm, test_loader, method="logpx")      # DataLoader or tensor
>>> s_out = jem.ood.score(jm, svhn_loader, method="logpx")
>>> jem.ood.evaluate(s_in, s_out)
{'auroc': 0.91, 'aupr_in': 0.93, 'aupr_out': 0.88, 'fpr95': 0.41}

Scores are looked up by name through the ``jem_register_ood_scores`` plugin hook, so a third
party adds one with ``register(name, fn, needs_grad=..., description=...)`` in a
``@jem_plugin.hookimpl``; :func:`available_scores` lists what is loaded. The built-ins live in
:mod:`jem_plugin.builtins.ood_scores` (the energy scores) and :mod:`jem_plugin.builtins.posthoc`
(the field's post-hoc detectors: ODIN, GEN, ASH, SCALE, and, fitted on in-distribution data,
Mahalanobis, relative Mahalanobis, ViM, KNN, ReAct).

Detectors that need training data are registered with ``needs_fit=True``; give the data with
``fit_data=`` (it is streamed, never held in memory), or fit one yourself and pass it::

    s = jem.ood.score(jm, test_loader, "mahalanobis", fit_data=train_loader)
    det = jem.ood.detector("knn", k=50).fit(jm, train_loader)
    s_in, s_out = jem.ood.score(jm, test_loader, det), jem.ood.score(jm, svhn_loader, det)

One forward for many detectors: :func:`outputs` computes a batch's logits, penultimate
features, last feature maps and layer outputs (only the kinds asked for) in one forward, and
detectors fit from and score them, as pytorch-ood's ``fit_features``/``predict_features`` do;
:func:`evaluate_all` does so for every score without an input gradient::

    out = jem.ood.outputs(jm, x, reads=det.reads, layers=det.layers_read)
    s = jem.ood.score_outputs(jm, out, det)          # or a name: score_outputs(jm, out, "msp")

A detector is a :class:`Detector`: the base class of the fitted ones, built-in or a plugin's,
which declares on its class its metadata, its fit's memory (:meth:`Detector.memory_estimate`,
refused over its limit before it allocates) and how its fit combines across ranks; a subclass
writes the statistic and gets ``fit``, ``score`` and the streaming ``begin_fit`` /
``add_outputs`` / ``end_fit`` (see the post-hoc guide's "Your own detector"). An object of your
own with ``.score(jm, x)`` is still accepted as a method.

Metrics (:func:`evaluate`) come from scikit-learn, the maintained reference, not hand-written
curves; ``fpr95`` follows pytorch-ood's ``fpr_at_tpr`` exactly (first ROC point whose TPR is
at least 95%, no interpolation).
"""

from __future__ import annotations

from ._detector import Detector, Estimate, FitShape
from ._ood_compare import evaluate_all
from ._ood_metrics import Best, OODTable, evaluate
from ._ood_metrics import _as_scores as _as_scores  # for viz: the same checks of scores
from ._ood_score import _HOOK as _HOOK  # for the CLI: the registry's hook name
from ._ood_score import _check_method_kwargs as _check_method_kwargs  # for the CLI
from ._ood_score import _method_names as _method_names  # for the CLI
from ._ood_score import available_scores, detector, score, score_info, score_outputs
from ._outputs import KINDS, Outputs, outputs

# Three ideas, one module each: scoring by name or detector (_ood_score), the metrics and the
# table (_ood_metrics), and comparing many scores over one shared forward (_ood_compare); the
# detector contract is _detector. This module is their public face: user code and the docs
# import from jem_plugin.ood.
__all__ = [
    "score",
    "available_scores",
    "score_info",
    "detector",
    "Detector",
    "FitShape",
    "Estimate",
    "evaluate",
    "evaluate_all",
    "Outputs",
    "outputs",
    "score_outputs",
    "KINDS",
    "OODTable",
    "Best",
]
