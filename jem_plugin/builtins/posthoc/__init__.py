"""The field's post-hoc OOD detectors, registered through the ``jem_register_ood_scores`` hook.

A built-in plugin like :mod:`jem_plugin.builtins.ood_scores`: :mod:`jem_plugin.plugins` registers
it at start-up and :func:`jem_plugin.ood.score` finds these by name. Same convention as every
score of the library: **higher = more in-distribution** (pytorch-ood's detectors return outlier
scores, the negatives of ours up to the scale noted per detector).

Logit and feature scores that need no training data are functions ``fn(jm, x, **options)``:

=======  ===================================================================  ===========
name     score                                                                input grad
=======  ===================================================================  ===========
odin     ``max softmax(f(x') / T)`` at ``x' = x - eps * sign(-d log S_y/dx)``  yes
         (Liang et al. 2018; ``eps`` in [0, 1]-pixel units)
gen      ``-sum_j p_j^g (1 - p_j)^g`` over the ``M`` largest probabilities    no
         (generalized entropy, Liu et al. 2023; ``gamma = 0.1``,
         ``M = min(K, 100)``)
ash      energy of the logits from ASH-S activations: the top ``100 - p`` %    no
         kept and scaled by ``exp(sum / kept sum)`` (Djurisic et al. 2023;
         ``percentile = 90``); on the last feature maps where the adapter
         gives them, else the penultimate features
scale    energy of the logits from ``h * exp(sum h / top sum h)`` (SCALE,      no
         Xu et al. 2024; ``percentile = 85``); the same activations as ash
=======  ===================================================================  ===========

Feature detectors fitted on in-distribution training data are classes (registered with
``needs_fit=True``): ``Detector(**options).fit(jm, data).score(jm, x)``. ``fit`` *streams* over
``data`` (a DataLoader, any iterable of batches, a tensor, or an ``(x, y)`` pair of tensors): it
keeps running sums, never the whole set, except KNN's bank of normalised features (``max_fit=``
keeps a uniform subsample) and a bounded uniform subsample where a statistic needs the data
itself (ReAct's percentile, ViM's alpha). OpenMax streams twice (class means, then the distances
to them), so its data must be iterable twice (not a one-shot generator).

====================  ==============================================================  ==========
name                  score                                                           fit keeps
====================  ==============================================================  ==========
mahalanobis           ``-min_c (z - mu_c)^T S^+ (z - mu_c)``, class means and shared   ``D x D``
                      covariance (Lee et al. 2018, no input preprocessing)
relative_mahalanobis  mahalanobis minus the distance under one Gaussian of all data     ``D x D``
                      (Ren et al. 2021)
vim                   ``logsumexp f - alpha ||P_res (z - u)||`` (Wang et al. 2022)      ``D x D``
knn                   ``-||z/|z| - n_k||``, distance to the k-th nearest normalised    ``N x D``
                      training feature (Sun et al. 2022; ``k = 50``)
react                 energy of the head on features clipped at the ``p``-th            a sample
                      percentile of training activations (Sun et al. 2021; ``p = 90``)
mahalanobis_odin      mahalanobis at ``x' = x - eps sign(d/dx min_c d_c(x))``, Lee      ``D x D``
                      et al.'s input preprocessing (input gradient; ``eps = 0.002``)
gmm                   ``log sum_c pi_c N(z | mu_c, S_c + reg I)``, one covariance       ``K x D x D``
                      per class, ``pi_c`` the class frequencies (``reg = 1e-6``)
openmax               ``-P(unknown)`` once the top ``alpha`` logits are revised by      ``K x K``
                      per-class Weibull fits of their distances to the class mean
                      logits (Bendale & Boult 2016; ``tailsize = 25``, ``alpha = 10``)
multi_mahalanobis     ``-sum_l w_l min_c`` Mahalanobis distance of layer ``l``'s         ``C_l x C_l``
                      pooled output, Lee et al.'s feature ensemble (``weights="dof"``:    per layer
                      ``w_l = 1 / sqrt(2 rank_l)``)
gram                  ``-sum_l delta_l / E_l``, how far the Gram-matrix row sums of       ``K x sum C_l``
                      layer ``l``'s maps fall outside the per-class training range       per power
                      (Sastry & Oore 2020; ``powers = 10``)
====================  ==============================================================  ==========

The rest of the field (issue 46), each equal to pytorch-ood's detector of the same name at matched
settings where it has one (AdaSCALE and WeiPer: to their authors' formulas):

============  ====================================================================  ==============
name          score                                                                 reads
============  ====================================================================  ==============
entropy       ``sum_j p_j log p_j``, minus the softmax entropy                      logits
weighted_ebo  ``log sum_j relu(w_j) exp f_j``, VOS's weighted energy                logits
kl_matching   ``-min_k KL(p || d_k)``, ``d_k`` the mean posterior of the fit        logits, fit
              inputs predicted as ``k`` (Hendrycks et al. 2022)
mcd           ``-mean_j var_s p_sj`` over 30 passes with dropout on (Gal &          logits x 30
              Ghahramani 2016); refuses a network without dropout
dice          energy of the head with its 90 % least contributing weights masked    features, fit
              (Sun & Li 2022)
she           ``<z, S_yhat>``, ``S_c`` the mean correctly classified features       features, fit
nnguide       energy times the mean similarity to the ``k = 10`` nearest            features, fit
              energy-scaled training features (Park et al. 2023)
fdbd          mean distance to the decision boundaries over ``|z - mu|``            features, fit
nci           alignment of ``z - mu`` with the predicted class's weights            features, fit
              (+ ``alpha |z|_1``, ``alpha = 0``)
pnml          minus the pNML regret (Bibas et al. 2021)                             features, fit
lts           energy of ``S^2 f``, ``S = sum relu z / top-5 % sum``                 features
vra           energy of the features clipped at the 10th and 90th training          features, fit
              percentiles (Xu et al. 2023)
adascale      SCALE at a percentile set by how far a small input step moves the     features, fit,
              features (Regmi et al. 2025)                                          input grad
rankfeat      energy of the last feature maps minus their rank-1 part               feature maps
weiper        WeiPer+KLD: histograms of the features and of perturbed logits        features, fit
              against the training ones, plus their MSP (Granz et al. 2024)
============  ====================================================================  ==============

Features are :meth:`jem_plugin.JEM.features` (penultimate, ``[B, D]``), or for
``multi_mahalanobis`` :meth:`jem_plugin.JEM.layer_features` (several layers, pooled), for ``gram``
:meth:`jem_plugin.JEM.layer_maps` (the same layers, unpooled); the "head" is
:meth:`jem_plugin.JEM.head`, the layer that maps them to the logits. Feature maps are
:meth:`jem_plugin.JEM.feature_maps` (``[B, C, H, W]`` before the classifier's pooling).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...plugins import hookimpl
from .activation import VRA, AdaSCALE, lts, rankfeat
from .dropout import mcd
from .feature_space import FDBD, NCI, PNML, SHE, NNGuide
from .gaussian import Mahalanobis, MahalanobisODIN, MultiMahalanobis, RelativeMahalanobis
from .gmm import GMM
from .gram import Gram
from .knn import KNN
from .logit import KLMatching, entropy, weighted_ebo
from .openmax import OpenMax
from .shaping import ReAct, ash, scale
from .softmax import gen, odin
from .sparsification import DICE
from .vim import ViM
from .weiper import WeiPer

__all__ = [
    "odin",
    "gen",
    "ash",
    "scale",
    "Mahalanobis",
    "RelativeMahalanobis",
    "MahalanobisODIN",
    "MultiMahalanobis",
    "Gram",
    "GMM",
    "ViM",
    "KNN",
    "ReAct",
    "OpenMax",
    "entropy",
    "weighted_ebo",
    "lts",
    "rankfeat",
    "mcd",
    "KLMatching",
    "DICE",
    "SHE",
    "NNGuide",
    "FDBD",
    "NCI",
    "PNML",
    "VRA",
    "AdaSCALE",
    "WeiPer",
]


#: Every detector of the package, in the order registered. Each keeps what the registry says of
#: it: a fitted detector on its class, a function score on itself (:func:`._base.describe`).
DETECTORS: tuple[Any, ...] = (
    odin,
    gen,
    ash,
    scale,
    Mahalanobis,
    RelativeMahalanobis,
    MahalanobisODIN,
    MultiMahalanobis,
    Gram,
    GMM,
    ViM,
    KNN,
    ReAct,
    OpenMax,
    entropy,
    weighted_ebo,
    lts,
    rankfeat,
    mcd,
    KLMatching,
    DICE,
    SHE,
    NNGuide,
    FDBD,
    NCI,
    PNML,
    VRA,
    AdaSCALE,
    WeiPer,
)


@hookimpl
def jem_register_ood_scores(register: Callable[..., None]) -> None:
    for d in DETECTORS:
        register(
            d.name,
            d,
            needs_grad=d.needs_grad,
            needs_fit=d.needs_fit,
            description=d.description,
            paper=d.paper,
            # a function score of outputs already computed: what it reads and the score of them
            **({"reads": d.reads, "score_outputs": d.score_outputs} if getattr(d, "score_outputs", None) else {}),
        )
