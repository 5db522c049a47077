"""PGD-made negatives and a logistic contrast of data against them, after DAT.

DAT ("Dual Adversarial Training": Yin, Zhang, Steele, Shavit and Wang, ICLR 2026, arXiv
2510.13872; code at github.com/xuwangyin/DAT) trains the energy half of a JEM without Langevin
dynamics. Its negatives are made by projected gradient ascent on ``log p(x)`` (descent on the
energy) from fresh starts, without noise, and the energy is trained as a binary classifier of
data against those negatives, the logit being ``-E(x) = logsumexp_y f(x)[y]``::

    L_gen = BCE(-E(x_data), 1) + BCE(-E(x_neg), 0)
          = mean softplus(E(x_data)) + mean softplus(-E(x_neg))

Once a negative is clearly told apart from the data its gradient vanishes (the sigmoid
saturates), where the contrastive-divergence term ``mean E(x_data) - mean E(x_neg)`` of JEM keeps
pushing every energy at the same rate: that is the stability the paper reports. Its code
(``rebm/training/metrics.py`` and ``rebm/attacks/adv_attacks.py``) sets:

- the steps: each one moves a start along its gradient normalised to unit L2 length per sample,
  ``x <- x + step_size * g / ||g||_2``, then clamps to the data range (``eps = inf``: no ball
  around the start). ``step_size`` 0.1 on ``[0, 1]`` pixels at 32x32 (CIFAR), 2.0 on ImageNet;
- the starts: an auxiliary data set (80M Tiny Images, OpenImages), fresh at every iteration;
- the number of steps: a curriculum, from 0 up to 40-65, one more whenever the running AUC of data
  against negatives (by the logit) reaches a threshold (0.8 on CIFAR-10, 0.7 on ImageNet);
- the logit of the BCE: ``logsumexp`` (the PGD ascends the class logit of the data batch's labels);
- no offset on the logit (a constant added to every logit leaves cross-entropy unchanged, so the
  network can learn its own); the BCE averaged over data and negatives together;
- the classifier half trained adversarially (PGD on cross-entropy, L2 ``eps = 0.5``), a robust
  pre-trained classifier as the start and no BatchNorm: not part of this module.

Here the sampler is :class:`PGDNegatives`, a :class:`~jem_plugin.chains.ChainSampler` like SGLD:
it writes only its step (and its step size); the checks, the starts, the chain loop, the recording
and the divergence check are the base class's, shared with SGLD. Its starts come from the replay
buffer as SGLD's do: ``ReplayBuffer(..., reinit_freq=1.0)`` gives DAT's fresh starts at every draw
(from the buffer's init distribution: uniform noise, or a per-class Gaussian fitted from the
data), a smaller ``reinit_freq`` persistent chains. The loss is the ``logistic_contrast`` term
(:class:`LogisticContrastTerm`), registered through the ``jem_register_loss_terms`` hook::

    sampler = PGDNegatives(steps=20)
    loss_fn = jem.JEMLoss(sampler, jem.ReplayBuffer(1000, (1, 8, 8), reinit_freq=1.0), px_weight=0.0)
    loss_fn.add_term("logistic_contrast")

:func:`dat_setup` builds those pieces for a model and its data, as a recipe's ``build`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_count, check_positive
from ..chains import ChainSampler
from ..errors import InvalidInputError
from ..model import BatchNormMode, as_jem
from ..plugins import hookimpl

if TYPE_CHECKING:  # pragma: no cover
    from ..model import JEM
    from ..recipes import JEMSetup

__all__ = [
    "PGDNegatives",
    "LogisticContrastTerm",
    "logistic_contrast",
    "dat_setup",
    "NORMS",
    "TERM_NAME",
    "jem_register_loss_terms",
]

#: PGDNegatives(norm=...): the step follows the L2-normalised gradient (DAT) or its sign.
NORMS = ("l2", "linf")
#: The loss term's name in the ``jem_register_loss_terms`` registry.
TERM_NAME = "logistic_contrast"
#: PGDNegatives(step_size=None): DAT's CIFAR step, 0.1 on [0, 1] pixels, as a share of the range.
DAT_STEP_SHARE = 0.1
PGD_REMEDIES: tuple[str, ...] = (
    "a smaller step size or fewer steps, PGDNegatives(step_size=..., steps=...)",
    "the energy L2 regulariser, JEMLoss(l2_weight=...)",
    "restart training from the last good checkpoint",
)
# Every constructor setting a checkpoint carries (the generator travels as its state).
_SETTINGS = (
    "steps",
    "step_size",
    "eps",
    "norm",
    "clamp",
    "batchnorm",
    "start_steps",
    "auc_threshold",
    "auc_window",
)


class PGDNegatives(ChainSampler):
    """Negatives made by projected gradient ascent on ``log p(x)`` (DAT): a
    :class:`~jem_plugin.chains.ChainSampler`, run, sampled and checked as SGLD is.

    Each step moves every chain along the input gradient of its unnormalised log density
    (``logsumexp_y f(x)[y]``; ``f(x)[y]`` for chains drawn for labels ``y``), normalised per chain
    (``norm="l2"``: ``g / ||g||_2``, DAT's; ``"linf"``: ``sign(g)``), times ``step_size``; then
    projects onto the ``eps`` ball around the chain's start (in the same norm) and clamps to the
    model's input domain. No noise: a step costs one forward and one input-gradient backward, as
    an SGLD step does.

    Parameters
    ----------
    steps: steps per chain (with a curriculum, the most it reaches).
    step_size: the length of each step in the model's input units (L2 length per chain for
        ``"l2"``, per-pixel change for ``"linf"``). ``None``: DAT's CIFAR value, 0.1 of the
        input domain's width (0.1 on ``[0, 1]`` pixels, 0.2 on ``[-1, 1]``).
    eps: radius of the ball around each start the chain stays in; ``inf`` (DAT's) for none.
    norm: one of :data:`NORMS`.
    clamp: clamp the chains to the model's input domain after every step (DAT's data range). Also
        tells :class:`~jem_plugin.losses.JEMLoss` to keep its data noise inside the domain.
    batchnorm: as :class:`~jem_plugin.sampling.SGLD`'s: ``"joint"`` (chains normalised with the
        running statistics; in the loss the negatives share BatchNorm with the data) or
        ``"separate"`` (chains and the loss's pass over them normalised by their own batch
        statistics, the running statistics left to the data).
    start_steps: ``None`` (default): always ``steps`` steps. A number turns on DAT's curriculum:
        the chains start with ``start_steps`` steps (DAT: 0) and take one more, up to ``steps``,
        whenever the mean of the last ``auc_window`` AUCs given to :meth:`observe_auc` reaches
        ``auc_threshold``. The ``logistic_contrast`` term reports them when built with
        ``curriculum=`` this sampler.
    auc_threshold, auc_window: the curriculum's rule (DAT: 0.8 on CIFAR-10 over 1,000 images, 8
        batches of 128).
    generator: a ``torch.Generator`` for the buffer's draws and the uniform starts.

    The model's train/eval flags, ``requires_grad`` flags, BatchNorm statistics and ``.grad`` are
    left as they were, as SGLD leaves them.
    """

    name = "PGD negatives"
    remedies = PGD_REMEDIES
    step_size: float | None

    def __init__(
        self,
        steps: int = 20,
        step_size: float | None = None,
        *,
        eps: float = math.inf,
        norm: Literal["l2", "linf"] = "l2",
        clamp: bool = True,
        batchnorm: BatchNormMode = "joint",
        start_steps: int | None = None,
        auc_threshold: float = 0.8,
        auc_window: int = 8,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(steps, clamp=clamp, batchnorm=batchnorm, generator=generator)
        self.step_size = None if step_size is None else check_positive("step_size", step_size)
        self.eps = check_positive("eps", eps, allow_inf=True)
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        self.norm: str = norm
        if start_steps is not None and check_count("start_steps", start_steps, 0) > steps:
            raise ValueError(f"start_steps ({start_steps}) must be at most steps ({steps})")
        self.start_steps = start_steps
        if not 0.5 <= float(auc_threshold) <= 1.0:
            raise ValueError(f"auc_threshold must be in [0.5, 1], got {auc_threshold!r}")
        self.auc_threshold = float(auc_threshold)
        self.auc_window = check_count("auc_window", auc_window, 1)
        #: The steps the next chains take (``steps`` without a curriculum).
        self.current_steps: int = steps if start_steps is None else start_steps
        self._aucs: list[float] = []

    def __repr__(self) -> str:
        size = "0.1 of the domain" if self.step_size is None else f"{self.step_size:g}"
        extra = "" if math.isinf(self.eps) else f", eps={self.eps:g}"
        if self.norm != "l2":
            extra += f", norm={self.norm!r}"
        if self.batchnorm != "joint":
            extra += f", batchnorm={self.batchnorm!r}"
        if self.start_steps is not None:
            extra += f", curriculum {self.start_steps}..{self.steps} at AUC {self.auc_threshold:g} (now {self.current_steps})"
        return f"PGDNegatives(steps={self.steps}, step_size={size}{extra}, clamp={self.clamp})"

    # ------------------------------------------------------------------ the curriculum
    def observe_auc(self, auc: float) -> bool:
        """Report one batch's AUC of data against negatives (higher: told apart better); returns
        whether the chains take one more step from now on. Does nothing without a curriculum."""
        if self.start_steps is None or self.current_steps >= self.steps:
            return False
        self._aucs.append(float(auc))
        del self._aucs[: -self.auc_window]
        if len(self._aucs) < self.auc_window or sum(self._aucs) / len(self._aucs) < self.auc_threshold:
            return False
        self.current_steps += 1
        self._aucs.clear()  # DAT starts a new window at every step count
        return True

    # ------------------------------------------------------------------ chains
    def step_length(self, jm: JEM) -> float:
        """The step size for ``jm``'s input domain (``step_size``, or 0.1 of the domain's mean width)."""
        if self.step_size is not None:
            return self.step_size
        domain = as_jem(jm, "PGDNegatives.step_length").domain
        widths = [hi - lo for lo, hi in zip(domain.low, domain.high)]
        return DAT_STEP_SHARE * sum(widths) / len(widths)

    def step_sizes(self, jm: Any = None) -> list[float]:
        """:attr:`current_steps` steps of :meth:`step_length` each."""
        if self.step_size is None and jm is None:
            raise ValueError("PGDNegatives(step_size=None) scales its step to a model's domain: pass the model")
        return [self.step_length(jm)] * self.current_steps

    def prepare(self, jm: JEM, x: Tensor) -> Tensor | None:
        """The starts, when the chains stay in an ``eps`` ball around them."""
        return x.clone() if math.isfinite(self.eps) else None

    def step(self, x: Tensor, grad: Tensor, size: float | Tensor, state: Tensor | None) -> None:
        """``x <- x + size * g / ||g||_2`` (``"l2"``) or ``x + size * sign(g)`` (``"linf"``), then
        back onto the ``eps`` ball around the starts."""
        flat = (-1,) + (1,) * (x.dim() - 1)  # per-chain scalars broadcast over the chain
        if self.norm == "l2":
            x.addcdiv_(grad, grad.flatten(1).norm(dim=1).clamp_min(1e-12).view(flat), value=float(size))
        else:
            x.add_(grad.sign(), alpha=float(size))
        if state is not None:
            self._project(x, state, flat)

    def _project(self, x: Tensor, start: Tensor, flat: tuple[int, ...]) -> None:
        """Pull ``x`` back onto the ``eps`` ball around ``start`` (in place)."""
        delta = x - start
        if self.norm == "l2":
            norms = delta.flatten(1).norm(dim=1).clamp_min(1e-12)
            delta.mul_((self.eps / norms).clamp(max=1.0).view(flat))
        else:
            delta.clamp_(-self.eps, self.eps)
        x.copy_(start + delta)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Every setting, the curriculum's place and the generator's state (plain values)."""
        state: dict[str, Any] = {name: getattr(self, name) for name in _SETTINGS}
        state["current_steps"] = self.current_steps
        state["aucs"] = list(self._aucs)
        state.update(super().state_dict())  # the generator's state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (the settings checked together, as the constructor does)."""
        settings = {name: state.get(name, getattr(self, name)) for name in _SETTINGS}
        checked = PGDNegatives(**settings)
        for name in _SETTINGS:
            setattr(self, name, getattr(checked, name))
        self.current_steps = min(int(state.get("current_steps", checked.current_steps)), self.steps)
        self._aucs = [float(a) for a in state.get("aucs", [])]
        super().load_state_dict(state)  # the generator


# ---------------------------------------------------------------------------- the loss term
def logistic_contrast(energy_data: Tensor, energy_neg: Tensor, offset: float = 0.0) -> Tensor:
    """DAT's logistic contrast, ``(BCE(offset - E_data, 1) + BCE(offset - E_neg, 0)) / 2``, each
    BCE a mean over its rows: ``(mean softplus(E_data - offset) + mean softplus(offset - E_neg)) / 2``.

    With as many negatives as data this is DAT's ``BCEWithLogitsLoss`` over the concatenated
    batch; otherwise data and negatives still count half each. Usable from any training loop.
    """
    return 0.5 * (F.softplus(energy_data - offset).mean() + F.softplus(offset - energy_neg).mean())


def _auc(energy_data: Tensor, energy_neg: Tensor) -> Tensor:
    """P(E_data < E_neg) + P(tie) / 2: how well the energy tells data from negatives (0-d tensor)."""
    d, n = energy_data.detach().reshape(-1, 1), energy_neg.detach().reshape(1, -1)
    return (d < n).float().mean() + 0.5 * (d == n).float().mean()


class LogisticContrastTerm:
    """The ``logistic_contrast`` loss term: ``weight * logistic_contrast(E(x_data), E(x_neg), offset)``.

    The negatives are the loss's samples (its p(x) chains, and its p(x|y) chains if any, each
    scored by its marginal energy ``E(x) = -logsumexp f(x)``, as DAT scores them); the term asks
    :class:`~jem_plugin.losses.JEMLoss` to draw them even with ``px_weight=0``, which is how it is
    meant to be used: ``JEMLoss(PGDNegatives(...), buffer, px_weight=0.0)`` then
    ``loss_fn.add_term("logistic_contrast")``. With SGLD as the sampler it is the same contrast on
    SGLD samples.

    Parameters
    ----------
    weight: multiplies the term (DAT: 1, beside the classifier's cross-entropy).
    offset: a constant added to every logit ``-E(x)`` (DAT: 0; the network can learn its own).
    curriculum: a :class:`PGDNegatives` with a curriculum (``start_steps=``): each training call
        (gradients on) reports its AUC to ``curriculum.observe_auc``. A term built with one is not
        rebuilt from a checkpoint by a loss that lacks it (a sampler is not plain data): add it
        again before loading, as :func:`dat_setup` does; the curriculum's place travels with the
        sampler's state.

    Metrics: ``auc`` (data against negatives by energy), ``data`` and ``negatives`` (the two BCE
    means), ``steps`` (the curriculum's current steps, when given one).
    """

    needs_samples = True

    def __init__(self, weight: float = 1.0, offset: float = 0.0, *, curriculum: PGDNegatives | None = None) -> None:
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")
        if not (isinstance(offset, (int, float)) and math.isfinite(offset)):
            raise ValueError(f"offset must be a finite number, got {offset!r}")
        if curriculum is not None and not callable(getattr(curriculum, "observe_auc", None)):
            raise TypeError(f"curriculum must have observe_auc(auc) (a PGDNegatives), got {type(curriculum).__name__}")
        self.weight, self.offset, self.curriculum = float(weight), float(offset), curriculum

    def __repr__(self) -> str:
        return f"LogisticContrastTerm(weight={self.weight}, offset={self.offset})"

    def __call__(self, jm: Any, batch: Any) -> tuple[Tensor, dict[str, Tensor | float]]:
        e_data, e_neg = batch.energy_data, batch.sample_energies
        if e_neg is None:
            raise InvalidInputError(
                "the logistic_contrast term needs negatives: JEMLoss draws them for a term that asks, "
                "unless its p(x|y) term is on without chains for p(x); keep pxy_weight=0 or px_weight>0"
            )
        pos = F.softplus(e_data - self.offset).mean()
        neg = F.softplus(self.offset - e_neg).mean()
        auc = _auc(e_data, e_neg)
        metrics: dict[str, Tensor | float] = {"auc": auc, "data": pos.detach(), "negatives": neg.detach()}
        training = torch.is_grad_enabled()  # validation runs without gradients
        if training and self.weight > 0 and hasattr(jm, "trained_px"):
            jm.trained_px = True  # log p(x) is trained: the scores that read it need not warn
        curriculum = self.curriculum
        if curriculum is not None:
            if training:
                curriculum.observe_auc(float(auc))
            metrics["steps"] = float(getattr(curriculum, "current_steps", math.nan))
        return self.weight * 0.5 * (pos + neg), metrics


@hookimpl
def jem_register_loss_terms(register: Callable[..., None]) -> None:
    register(
        TERM_NAME,
        LogisticContrastTerm,
        description="DAT's logistic (BCE) contrast of data against the loss's negatives, logit -E(x)",
    )


# ---------------------------------------------------------------------------- the pieces together
#: What DAT changes in a recipe (:func:`dat_setup` applies it to ``fast``'s): fresh starts at every
#: draw, no p(x) term, the negatives in the data's BatchNorm pass, BatchNorm running statistics
#: recomputed from the data after training.
DAT_RECIPE_CHANGES: dict[str, Any] = dict(
    buffer_reinit_freq=1.0, px_weight=0.0, sgld_batchnorm="joint", bn_stats_from_data=True
)


def use_pgd_negatives(
    loss: Any,
    batchnorm: Literal["joint", "separate"],
    *,
    steps: int = 20,
    step_size: float | None = None,
    curriculum: bool = False,
    weight: float = 1.0,
    generator: torch.Generator | None = None,
) -> PGDNegatives:
    """Replace ``loss``'s sampler (a :class:`~jem_plugin.losses.JEMLoss`) by :class:`PGDNegatives`
    (``steps``, ``step_size``, ``batchnorm``; with ``curriculum=True`` DAT's curriculum from 0
    steps) and add the ``logistic_contrast`` term at ``weight``; returns the sampler."""
    sampler = PGDNegatives(
        steps,
        step_size,
        batchnorm=batchnorm,
        start_steps=0 if curriculum else None,
        generator=generator,
    )
    loss.sampler = sampler
    loss.add_term(TERM_NAME, weight=weight, **({"curriculum": sampler} if curriculum else {}))
    return sampler


def dat_setup(
    jm: nn.Module,
    data: Any,
    *,
    steps: int = 20,
    step_size: float | None = None,
    curriculum: bool = False,
    weight: float = 1.0,
    n_samples: int = 32,
    total_iters: int | None = None,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
) -> JEMSetup:
    """The pieces of a DAT-style run for ``jm``: the ``fast`` recipe's (per-class Gaussian init
    fitted on ``data``, 32 negatives per iteration, Adam 3e-4 with 200 warm-up iterations, the
    energy L2 at 0.1) with its SGLD replaced by :class:`PGDNegatives` (``steps``, ``step_size``;
    with ``curriculum=True`` DAT's curriculum from 0 steps), fresh starts at every draw
    (``reinit_freq=1.0``), the p(x) term off and the ``logistic_contrast`` term at ``weight`` in
    its place.

    The negatives pass BatchNorm with the data (``batchnorm="joint"``, not ``fast``'s
    ``"separate"``), and the BatchNorm running statistics are recomputed from the data after
    training (:class:`~jem_plugin.extensions.RecomputeBatchNorm`, as ``generative`` does): normalised
    by their own batch statistics, the negatives lose what tells them from the data, and the energy
    learns little (on 8x8 digits, a BatchNorm CNN, 300 iterations: log p(x) AUROC against uniform
    noise 0.43 with ``"separate"``, 1.00 with ``"joint"``).

    Returns the :class:`~jem_plugin.recipes.JEMSetup` that :func:`jem_plugin.training.fit` runs
    (its ``recipe`` says the settings above; the sampler and the term are not recipe settings).
    ``data``, ``total_iters``, ``batch_size`` and ``generator`` as
    :meth:`Recipe.build <jem_plugin.recipes.Recipe.build>` takes them.
    """
    from ..recipes import get_recipe

    recipe = get_recipe("fast").replace(**DAT_RECIPE_CHANGES, n_samples=n_samples)
    setup = recipe.build(jm, data, total_iters=total_iters, batch_size=batch_size, generator=generator)
    sampler = use_pgd_negatives(
        setup.loss,
        recipe.sampler.batchnorm,
        steps=steps,
        step_size=step_size,
        curriculum=curriculum,
        weight=weight,
        generator=generator,
    )
    setup.sampler = sampler  # type: ignore[assignment]  # JEMSetup names SGLD; the loss takes any sampler
    setup.notes.append(f"DAT: {sampler!r} and the logistic_contrast term (weight {weight:g}) in place of SGLD and p(x)")
    return setup
