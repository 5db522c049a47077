"""Adversarial robustness: PGD attacks, JEM's SGLD input-refinement defence, robust accuracy curves.

**Attack.** :func:`pgd_attack` is projected gradient descent (Madry et al. 2018) under L-inf or
L2, written here rather than taken from a library, because

- it must clamp to the adapter's *per-channel* input domain: timm/torchvision models take
  normalised images whose valid range differs per channel, and ``eps`` must mean the usual
  pixel budget (8/255 of the ``[0, 1]`` range) whatever normalisation the loader applies.
  torchattacks clamps to ``[0, 1]`` and needs the model rewritten to take un-normalised input;
- it is about 60 lines and adds no dependency. torchattacks' last release (3.5.1) is from
  October 2023 and pins ``requests~=2.25.1``; the maintained alternatives (ART, foolbox,
  AutoAttack) are heavy or not on PyPI, and none knows our adapters' domains.

By default ``eps`` is measured in **unit space**: each channel's domain ``[low, high]`` mapped to
``[0, 1]``, i.e. ``x = low + (high - low) * u``. For inputs in ``[0, 1]`` that is the input
itself; for ImageNet-normalised inputs it is the un-normalised pixel; for JEM's ``[-1, 1]`` it
is ``(x + 1) / 2``. So ``eps=8/255`` means the same everywhere. Pass ``PGD(eps_space="input")`` to
measure ``eps`` in the raw units of the loader's tensors instead.

**Defence** (Grathwohl et al. 2019, Sec. 5.3): before classifying, refine the input with a few
SGLD steps on the model's own ``log p(x)`` (pulling it back towards the data manifold), run
several independent chains and average their logits (:class:`SGLDDefense`).

**Evaluating a stochastic defence** (:func:`robust_accuracy`). ``attack="transfer"`` (default)
crafts PGD examples against the undefended classifier and feeds them to the defence: cheap, but
only an *upper bound* on robust accuracy, because the attacker ignores the defence.
``attack="bpda"`` attacks through the defence with BPDA + EOT (Athalye et al. 2018): each PGD
step refines the current point with the defence's own chains, takes the gradient of the loss of
the chain-averaged logits at the refined points, and uses it as the gradient at the input (the
refinement's Jacobian approximated by the identity), averaged over ``PGD(eot_samples=...)``
independent refinements. It is the adaptive evaluation, but a refinement that makes the model
very confident can saturate the cross-entropy gradient (gradient masking); ``PGD(loss="margin")`` (the
Carlini-Wagner margin) avoids that, and ``attack="worst"`` counts an input as robust only if it
survives both attacks. Report ``"worst"`` when claiming robustness.

**Settings.** How PGD runs (norm, steps, step size, random start, objective, the space ``eps`` is
measured in, EOT samples) is one frozen :class:`PGD` value, shared by :func:`pgd_attack` and
:func:`robust_accuracy`:

>>> x_adv = pgd_attack(jm, x, y, 8 / 255, PGD(norm="linf", steps=20))
>>> r = robust_accuracy(jm, x, y, [0, 8 / 255], PGD(loss="margin", eot_samples=4), defense=d, attack="worst")
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ._checks import check_input, check_labels, draw
from .model import as_jem, input_grad_enabled, sampling_mode
from .sampling import SGLD

__all__ = ["PGD", "pgd_attack", "SGLDDefense", "robust_accuracy"]

NORMS = ("linf", "l2")
LOSSES = ("ce", "margin")
EPS_SPACES = ("unit", "input")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class PGD:
    """How projected gradient descent attacks: everything but the budget ``eps``.

    norm: ``"linf"`` or ``"l2"`` (L2 over all input dims of each example).
    steps: PGD iterations.
    step_size: per-step size in the same units as ``eps``; ``None`` (default): ``2.5 * eps /
        steps`` (Madry et al.).
    random_start: start uniformly in the L-inf ball, or at a random direction and radius in the
        L2 ball.
    loss: ``"ce"`` (cross-entropy, Madry et al.) or ``"margin"`` (Carlini-Wagner
        ``max_{j != y} f_j - f_y``, which keeps a useful gradient where cross-entropy saturates).
    eps_space: ``"unit"`` (default: each channel's domain mapped to ``[0, 1]``, so ``8/255`` means
        the same for every normalisation) or ``"input"`` (the raw units of the loader's tensors).
    eot_samples: refinements averaged per gradient when attacking an :class:`SGLDDefense`
        through BPDA + EOT (:func:`robust_accuracy` with ``attack="bpda"``/``"worst"``).
    """

    norm: str = "linf"
    steps: int = 10
    step_size: float | None = None
    random_start: bool = True
    loss: str = "ce"
    eps_space: str = "unit"
    eot_samples: int = 1

    def __post_init__(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.eps_space not in EPS_SPACES:
            raise ValueError(f"eps_space must be 'unit' or 'input', got {self.eps_space!r}")
        _check_int("steps", self.steps, 0)
        _check_int("eot_samples", self.eot_samples, 1)
        if self.step_size is not None and not (
            isinstance(self.step_size, (int, float)) and math.isfinite(self.step_size) and self.step_size > 0
        ):
            raise ValueError(f"step_size must be a finite number > 0 or None, got {self.step_size!r}")


def _pgd_settings(where: str, pgd: Any) -> PGD:
    """The :class:`PGD` a call asked for (``None``: the defaults)."""
    if pgd is None:
        return PGD()
    if not isinstance(pgd, PGD):
        raise TypeError(f"{where}: pgd must be a jem_plugin.robustness.PGD, got {type(pgd).__name__}")
    return pgd


# ---------------------------------------------------------------------- helpers
def _check_xy(jm, x: Any, y: Any) -> tuple[Tensor, Tensor]:
    core = as_jem(jm, "robustness")
    x = check_input(x, dtype=core.param_dtype(), domain=core.domain)
    return x, check_labels(y, x.shape[0], device=x.device)


def _space(jm, x: Tensor, eps_space: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(offset, scale, z_low, z_high)`` with ``x = offset + scale * z`` and the domain as z bounds."""
    lo, hi = jm.domain.bounds(x)
    if eps_space == "unit":
        scale = hi - lo
        return lo, scale, torch.zeros_like(lo), torch.ones_like(hi)
    return torch.zeros_like(lo), torch.ones_like(lo), lo, hi  # "input" (PGD checks the value)


def _rand(shape, like: Tensor, generator: torch.Generator | None, normal: bool = False) -> Tensor:
    return draw(torch.randn if normal else torch.rand, shape, generator, like.device, dtype=like.dtype)


def _per_example_norm(t: Tensor) -> Tensor:
    return t.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, *([1] * (t.dim() - 1)))


def _project(z: Tensor, z0: Tensor, eps: float, norm: str, zlo: Tensor, zhi: Tensor) -> Tensor:
    delta = z - z0
    if norm == "linf":
        delta = delta.clamp(-eps, eps)
    else:
        factor = (eps / _per_example_norm(delta)).clamp(max=1.0)
        delta = delta * factor
    return torch.max(torch.min(z0 + delta, zhi), zlo)


def _attack_loss(logits: Tensor, y: Tensor, loss: str) -> Tensor:
    """Summed attack objective to *maximise*: cross-entropy, or the Carlini-Wagner margin."""
    if loss == "ce":
        return F.cross_entropy(logits, y, reduction="sum")
    # max_{j != y} f_j - f_y: unlike cross-entropy it does not saturate (zero gradient) on
    # inputs the model classifies with near-certainty, e.g. after an SGLD refinement.
    true = logits.gather(1, y[:, None]).squeeze(1)
    other = logits.masked_fill(F.one_hot(y, logits.shape[1]).bool(), float("-inf")).max(1).values
    return (other - true).sum()


def _loss_grad(jm, x_eval: Tensor, y: Tensor, loss: str = "ce", n_chains: int = 1) -> Tensor:
    """Gradient of the attack loss of (chain-averaged) logits w.r.t. ``x_eval``."""
    with input_grad_enabled(x_eval) as xg:
        y = y.clone()  # a label tensor made under inference_mode cannot be saved for backward
        logits = jm(xg)
        if n_chains > 1:
            logits = logits.view(n_chains, -1, logits.shape[-1]).mean(0)
        (g,) = torch.autograd.grad(_attack_loss(logits, y, loss), xg)
    return g


# ---------------------------------------------------------------------- attack
def _pgd(
    jm,
    x: Tensor,
    y: Tensor,
    eps: float,
    pgd: PGD,
    generator: torch.Generator | None,
    grad_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> Tensor:
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if eps == 0:
        return x.detach().clone()
    norm, steps = pgd.norm, pgd.steps
    alpha = 2.5 * eps / max(steps, 1) if pgd.step_size is None else float(pgd.step_size)
    offset, scale, zlo, zhi = _space(jm, x, pgd.eps_space)
    z0 = (x.detach() - offset) / scale
    # Inputs already outside the domain (e.g. Gaussian noise through a normalised model) keep
    # their coordinates: the box is widened to contain x, so eps is always respected and no
    # coordinate moves further out than it already was.
    zlo, zhi = torch.min(zlo, z0), torch.max(zhi, z0)
    z = z0.clone()
    if pgd.random_start:
        if norm == "linf":
            z = z + (2 * _rand(z.shape, z, generator) - 1) * eps
        else:
            d = _rand(z.shape, z, generator, normal=True)
            r = _rand((z.shape[0],) + (1,) * (z.dim() - 1), z, generator)
            z = z + d / _per_example_norm(d) * r * eps
        z = _project(z, z0, eps, norm, zlo, zhi)
    for _ in range(steps):
        x_cur = offset + scale * z
        g = grad_fn(x_cur, y) if grad_fn is not None else _loss_grad(jm, x_cur, y, pgd.loss)
        g = g * scale  # chain rule: x = offset + scale * z
        if norm == "linf":
            z = z + alpha * g.sign()
        else:
            z = z + alpha * g / _per_example_norm(g)
        z = _project(z, z0, eps, norm, zlo, zhi)
    return (offset + scale * z).detach().to(x.dtype)


def pgd_attack(
    jm,
    x: Tensor,
    y: Tensor,
    eps: float,
    pgd: PGD | None = None,
    *,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Untargeted PGD on ``jm``'s logits; returns ``x_adv`` (detached).

    Parameters
    ----------
    eps: perturbation budget, in unit space by default (see the module docstring; ``8/255`` is
        the usual L-inf budget for images). ``eps=0`` returns a copy of ``x``.
    pgd: the attack's settings, :class:`PGD` (default ``PGD()``: L-inf, 10 steps, cross-entropy,
        random start, ``eps`` in unit space).
    generator: ``torch.Generator`` for the random start (reproducible attacks).

    ``x_adv`` stays within ``eps`` of ``x`` and inside the adapter's (per-channel) domain (a
    coordinate of ``x`` that is already outside it never moves further out). The
    model runs in eval mode with frozen parameters (restored after); no parameter ``.grad``
    is touched; works under ``torch.no_grad()`` and ``torch.inference_mode()``.
    """
    settings = _pgd_settings("pgd_attack", pgd)
    x, y = _check_xy(jm, x, y)
    with sampling_mode(jm):
        return _pgd(jm, x, y, eps, settings, generator)


# ---------------------------------------------------------------------- defence
class SGLDDefense:
    """JEM's adversarial defence: refine inputs with SGLD on ``log p(x)``, average logits over chains.

    ``defense(x)`` returns ``[B, K]`` logits: the mean over ``n_chains`` independent chains of
    ``f(x_refined)``, each chain started at ``x`` and run for ``steps`` SGLD steps
    (:class:`jem_plugin.sampling.SGLD`, clamped to the model's domain). ``steps=0`` is the
    undefended classifier. The paper's best configuration used ten refinement steps and
    averaged over several chains; step size and noise default to the paper's sampler (1.0,
    0.01), which suits JEM-trained models. For a plain classifier whose energy gradients are
    large, use a smaller ``step_size``.

    ``generator`` (here or per call) makes the defence reproducible. All chains of a batch run
    as one ``[n_chains * B, ...]`` SGLD batch; ``chunk_size`` caps that batch.
    """

    def __init__(
        self,
        jm,
        steps: int = 10,
        step_size: float = 1.0,
        noise: float = 0.01,
        n_chains: int = 10,
        *,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
        **sgld_kwargs: Any,
    ) -> None:
        if isinstance(n_chains, bool) or not isinstance(n_chains, int) or n_chains < 1:
            raise ValueError(f"n_chains must be a positive int, got {n_chains!r}")
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
        self.jm = jm
        self.steps = steps
        self.n_chains = n_chains
        self.generator = generator
        self.chunk_size = chunk_size
        self.sgld_kwargs = dict(step_size=step_size, noise=noise, **sgld_kwargs)
        self._sgld_cls = SGLD
        SGLD(steps=steps, **self.sgld_kwargs)  # validate the options now, not on first call

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.sgld_kwargs.items())
        return f"SGLDDefense(steps={self.steps}, n_chains={self.n_chains}, {opts})"

    def refine(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """The refined inputs of every chain, ``[n_chains * B, ...]`` (chain-major), detached."""
        gen = generator if generator is not None else self.generator
        sampler = self._sgld_cls(steps=self.steps, generator=gen, **self.sgld_kwargs)
        starts = x.detach().unsqueeze(0).expand(self.n_chains, *x.shape).reshape(-1, *x.shape[1:])
        if self.steps == 0:
            return starts.clone()
        with sampling_mode(self.jm):
            if self.chunk_size is None or starts.shape[0] <= self.chunk_size:
                return sampler.run(self.jm, starts)
            return torch.cat([sampler.run(self.jm, c) for c in starts.split(self.chunk_size)])

    def logits(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Chain-averaged logits ``[B, K]`` of the refined inputs."""
        refined = self.refine(x, generator)
        with sampling_mode(self.jm), torch.no_grad():
            out = self.jm(refined.to(x.dtype))
        return out.view(self.n_chains, x.shape[0], -1).mean(0)

    __call__ = logits

    def predict(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Predicted classes ``[B]`` of the defended classifier."""
        return self.logits(x, generator).argmax(1)

    def bpda_grad(self, x: Tensor, y: Tensor, eot_samples: int = 1, loss: str = "ce") -> Tensor:
        """BPDA + EOT gradient of the defended attack loss at ``x`` (refinement Jacobian ~ identity)."""
        total = torch.zeros_like(x)
        for _ in range(eot_samples):
            refined = self.refine(x)
            g = _loss_grad(self.jm, refined.to(x.dtype), y, loss, n_chains=self.n_chains)
            total += g.view(self.n_chains, *x.shape).sum(0)
        return total / eot_samples


# ---------------------------------------------------------------------- evaluation
def robust_accuracy(
    jm,
    x: Tensor,
    y: Tensor,
    eps_list: Sequence[float],
    pgd: PGD | None = None,
    defense: SGLDDefense | Callable[[Tensor], Tensor] | None = None,
    *,
    attack: str = "transfer",
    generator: torch.Generator | None = None,
    batch_size: int = 256,
    progress: bool = True,
) -> dict[str, Any]:
    """Accuracy under PGD for every ``eps`` in ``eps_list``.

    Without a defence, PGD attacks ``jm`` directly (white box). With ``defense`` (an
    :class:`SGLDDefense` or any callable ``x -> logits``), predictions come from the defence
    and ``attack`` is

    - ``"transfer"`` (default): PGD on the undefended ``jm``; an upper bound on robust accuracy;
    - ``"bpda"``: BPDA + EOT through an :class:`SGLDDefense` (module docstring);
    - ``"worst"``: an input counts as robust only if it survives both (per-example worst case,
      the honest number: a refinement can saturate the BPDA gradient, and then transfer wins).

    ``pgd`` is how PGD runs (:class:`PGD`: norm, steps, objective ``"ce"`` or ``"margin"``, EOT
    samples for BPDA, ...). ``eps = 0`` is not attacked, so its entry is clean accuracy.

    Returns ``{"eps": [...], "accuracy": [...], "correct": [...], "norm", "attack", "steps", "n"}``;
    ``"correct"`` holds, for each ``eps``, whether each input survived (a list of ``n`` bools), for
    paired comparisons of two models on the same inputs.
    """
    settings = _pgd_settings("robust_accuracy", pgd)
    norm, loss, eot_samples = settings.norm, settings.loss, settings.eot_samples
    x, y = _check_xy(jm, x, y)
    eps_values = [float(e) for e in eps_list]
    if not eps_values:
        raise ValueError("eps_list is empty: give at least one budget, e.g. [0, 2/255, 8/255]")
    if attack not in ("transfer", "bpda", "worst"):
        raise ValueError(f"attack must be 'transfer', 'bpda' or 'worst', got {attack!r}")
    if attack in ("bpda", "worst") and not isinstance(defense, SGLDDefense):
        raise ValueError(f"attack={attack!r} needs defense=SGLDDefense(...) (BPDA uses the defence's chains)")
    predict = defense if defense is not None else jm
    bpda_label = f"bpda-eot{eot_samples}"
    label = (
        "pgd"
        if defense is None
        else {"transfer": "pgd-transfer", "bpda": f"pgd-{bpda_label}", "worst": f"pgd-worst(transfer,{bpda_label})"}[
            attack
        ]
    )
    if loss != "ce":
        label += f"-{loss}"

    def bpda_grad(x_cur: Tensor, y_b: Tensor) -> Tensor:
        assert isinstance(defense, SGLDDefense)  # checked above for the attacks that call bpda_grad
        return defense.bpda_grad(x_cur, y_b, eot_samples, loss)

    plan_table: dict[str, list[Callable[[Tensor, Tensor], Tensor] | None]] = {
        "transfer": [None],
        "bpda": [bpda_grad],
        "worst": [None, bpda_grad],
    }
    plans = plan_table[attack if defense is not None else "transfer"]
    accs, survived = [], []
    batches = list(zip(x.split(batch_size), y.split(batch_size)))
    with (
        sampling_mode(jm),
        tqdm(
            total=len(eps_values) * len(batches), desc=f"robust acc ({norm})", disable=not progress, leave=False
        ) as bar,
    ):
        for eps in eps_values:
            oks = []
            for xb, yb in batches:
                ok = torch.ones_like(yb, dtype=torch.bool)
                for grad_fn in plans if eps > 0 else [None]:
                    xa = xb if eps == 0 else _pgd(jm, xb, yb, eps, settings, generator, grad_fn=grad_fn)
                    with torch.no_grad():
                        ok &= predict(xa).argmax(1) == yb
                oks.append(ok.cpu())
                bar.update(1)
            survived.append(torch.cat(oks))
            accs.append(int(survived[-1].sum()) / x.shape[0])
    n = int(x.shape[0])
    correct = [s.tolist() for s in survived]
    return {
        "eps": eps_values,
        "accuracy": accs,
        "correct": correct,
        "norm": norm,
        "attack": label,
        "steps": settings.steps,
        "n": n,
    }
