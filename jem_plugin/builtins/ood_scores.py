"""Built-in OOD scores, registered through the ``jem_register_ood_scores`` hook.

This module is a plugin like any third-party one: :mod:`jem_plugin.plugins` registers it at
start-up and :func:`jem_plugin.ood.score` finds its scores by name through the hook. Every score
is ``fn(jm, x, **kwargs) -> Tensor[B]`` and follows the library's convention:
**higher = more in-distribution**.

=============  ===========================================================  ==========
name           score                                                        input grad
=============  ===========================================================  ==========
logpx          ``T * logsumexp(f(x) / T)``: negative free energy (Liu et al.  no
               2020) = unnormalised ``log p(x)`` of JEM at ``T = 1``
msp            ``max_y softmax(f(x) / T)`` (Hendrycks & Gimpel 2017)          no
max_logit      ``max_y f(x)`` (Hendrycks et al. 2022)                         no
grad_norm      ``-||d log p(x) / dx||_2`` per example: JEM's "approximate     yes
               mass" (Grathwohl et al. 2019, Sec. 5.2)
grad_norm_     ``grad_norm`` without the components that point out of the     yes
projected      input domain at boundary inputs (saturated pixels)
logpx_sgld     ``logpx`` after a few SGLD steps started at the input          yes
msp_sgld       ``msp`` after a few SGLD steps started at the input            yes
=============  ===========================================================  ==========

The last four assume a JEM-trained model: they read ``log p(x)`` as a trained density, which
a classifier trained with cross-entropy alone does not have (on such models they can rank OOD
inputs above in-distribution ones). Called on a model whose ``jm.trained_px`` is not ``True``
they warn once per model (:class:`~jem_plugin.errors.UntrainedDensityWarning`) and name the
scores that need no such training. ``JEMLoss`` sets the flag when it trains a p(x) or p(x|y)
term; set ``jm.trained_px = True`` yourself for a model trained as a JEM elsewhere.

Gradient scores run the model in :func:`jem_plugin.model.sampling_mode` (eval mode, parameters
frozen, both restored after), take gradients with respect to the input only (no parameter
``.grad`` is touched) and work under ``torch.no_grad()`` and
``torch.inference_mode()`` (see :func:`jem_plugin.model.input_grad_enabled`).
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._checks import free_energy, unwrap_model
from .._outputs import Outputs
from ..errors import UntrainedDensityWarning
from ..model import JEM, input_grad_enabled, sampling_mode
from ..plugins import collect, hookimpl

__all__ = ["logpx", "msp", "max_logit", "grad_norm", "grad_norm_projected", "logpx_sgld", "msp_sgld"]


def _check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not t > 0 or t != t or t == float("inf"):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    return t


#: The scores that read ``log p(x)`` as a trained density (registered with ``assumes_jem=True``).
ASSUMES_JEM = ("grad_norm", "grad_norm_projected", "logpx_sgld", "msp_sgld")


# The models already warned about: weak references, so a model's lifetime is its own.
_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()


def warn_if_untrained(jm: Any, name: str) -> None:
    """Warn once per model that score ``name`` assumes a JEM-trained model, unless
    ``jm.trained_px`` is ``True``. One attribute read when it is (or after the warning)."""
    core = unwrap_model(jm)
    trained = core.trained_px if isinstance(core, JEM) else None
    try:
        if trained is True or core in _WARNED:
            return
        _WARNED.add(core)
    except TypeError:  # a model that cannot be weakly referenced: warn every time
        pass
    entries = collect("jem_register_ood_scores")
    others = sorted(n for n, e in entries.items() if not e.get("assumes_jem") and n not in ASSUMES_JEM)
    warnings.warn(
        f"the OOD score {name!r} assumes a JEM-trained model (as grad_norm, grad_norm_projected, "
        "logpx_sgld and msp_sgld all do): it reads log p(x) = logsumexp f(x) as a trained density, and "
        f"this model's log p(x) was not trained (jm.trained_px is {trained!r}); on "
        "a cross-entropy classifier these scores can rank OOD inputs above in-distribution ones. "
        f"Scores that do not assume it: {', '.join(others)}. Train with jem.JEMLoss (px_weight > 0), "
        "or set jm.trained_px = True if the model was trained as a JEM elsewhere.",
        UntrainedDensityWarning,
        stacklevel=_first_frame_outside_the_library(),
    )


def _first_frame_outside_the_library() -> int:
    """The ``stacklevel`` that points a warning issued by our caller at the user's line: the
    first frame whose file is not inside the ``jem_plugin`` package."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


# ---------------------------------------------------------------------- logit-only scores
def _logpx(jm, out: Outputs, temperature: float = 1.0) -> Tensor:
    """:func:`logpx` of a batch's outputs (its logits)."""
    t = _check_temperature(temperature)
    return -free_energy(out.logits, t)


def _msp(jm, out: Outputs, temperature: float = 1.0) -> Tensor:
    """:func:`msp` of a batch's outputs (its logits)."""
    t = _check_temperature(temperature)
    logits = out.logits
    return torch.softmax(logits / t if t != 1.0 else logits, dim=1).max(dim=1).values


def _max_logit(jm, out: Outputs) -> Tensor:
    """:func:`max_logit` of a batch's outputs (its logits)."""
    return out.logits.max(dim=1).values


def logpx(jm, x: Tensor, temperature: float = 1.0) -> Tensor:
    """Negative free energy ``T * logsumexp(f(x) / T)``; JEM's unnormalised ``log p(x)`` at ``T = 1``."""
    _check_temperature(temperature)
    return _logpx(jm, Outputs(jm.logits(x)), temperature)


def msp(jm, x: Tensor, temperature: float = 1.0) -> Tensor:
    """Maximum softmax probability of ``f(x) / T``."""
    _check_temperature(temperature)
    return _msp(jm, Outputs(jm.logits(x)), temperature)


def max_logit(jm, x: Tensor) -> Tensor:
    """Largest logit ``max_y f(x)[y]``."""
    return _max_logit(jm, Outputs(jm.logits(x)))


# ---------------------------------------------------------------------- gradient scores
def grad_norm(jm, x: Tensor, project: bool = False) -> Tensor:
    """JEM's approximate mass ``-||d log p(x) / dx||_2`` (L2 over all input dims, per example).

    In-distribution inputs sit near modes of ``p(x)`` where the gradient is small, so a
    larger gradient norm means less in-distribution. Eval mode makes examples independent
    (no BatchNorm batch statistics), so the gradient of the summed ``log p`` is per example.

    ``project=True`` drops the gradient components that point out of the model's input domain
    at inputs on its boundary (a saturated pixel whose density rises beyond the range), i.e. the
    gradient of ``log p`` restricted to the domain. Why: data with many saturated pixels (digits,
    line art, clipped photos) puts probability mass *on* the boundary, so the density of a
    trained JEM keeps rising towards it and those components, which no valid input can follow,
    dominate the plain norm of real data. Measured on the digits (benchmarks/README.md): they
    carry 60-90% of the squared norm of test digits, and for models trained with the paper's
    optimiser the plain score ranks noise as *more* in-distribution than digits (AUROC 0.06)
    while the projected one reaches 0.97. Inside the domain both are equal.

    Assumes a JEM-trained model (warns once otherwise, see the module's notes).
    """
    warn_if_untrained(jm, "grad_norm_projected" if project else "grad_norm")
    with sampling_mode(jm), input_grad_enabled(x) as xg:
        lp = -free_energy(jm.logits(xg))
        (g,) = torch.autograd.grad(lp.sum(), xg)
    if project:
        xd = x.detach().to(g.dtype)
        lo, hi = jm.domain.bounds(xd)
        tol = 1e-6 * (hi - lo)
        outward = ((xd <= lo + tol) & (g < 0)) | ((xd >= hi - tol) & (g > 0))
        g = g.masked_fill(outward, 0.0)
    return -g.flatten(1).norm(dim=1).detach()


def grad_norm_projected(jm, x: Tensor) -> Tensor:
    """:func:`grad_norm` with ``project=True``: the gradient restricted to the input domain."""
    warn_if_untrained(jm, "grad_norm_projected")
    return grad_norm(jm, x, project=True)


def _refine(jm, x: Tensor, steps: int, step_size: float, noise: float, **sgld_kwargs) -> Tensor:
    from ..sampling import SGLD  # lazy: the sampler imports the model machinery

    with sampling_mode(jm):
        return SGLD(steps=steps, step_size=step_size, noise=noise, **sgld_kwargs).run(jm, x).detach()


def logpx_sgld(
    jm, x: Tensor, steps: int = 5, step_size: float = 1.0, noise: float = 0.01, temperature: float = 1.0, **sgld_kwargs
) -> Tensor:
    """``logpx`` of the input after ``steps`` SGLD steps started at it (JEM-style input refinement).

    Extra keyword arguments (``generator``, ...) go to :class:`jem_plugin.sampling.SGLD`.
    Assumes a JEM-trained model (warns once otherwise).
    """
    warn_if_untrained(jm, "logpx_sgld")
    x_ref = _refine(jm, x, steps, step_size, noise, **sgld_kwargs)
    with torch.no_grad():
        return logpx(jm, x_ref, temperature=temperature)


def msp_sgld(
    jm, x: Tensor, steps: int = 5, step_size: float = 1.0, noise: float = 0.01, temperature: float = 1.0, **sgld_kwargs
) -> Tensor:
    """``msp`` of the input after ``steps`` SGLD steps started at it (assumes a JEM-trained model)."""
    warn_if_untrained(jm, "msp_sgld")
    x_ref = _refine(jm, x, steps, step_size, noise, **sgld_kwargs)
    with torch.no_grad():
        return msp(jm, x_ref, temperature=temperature)


@hookimpl
def jem_register_ood_scores(register: Callable[..., None]) -> None:
    # the logit scores also score outputs already computed (jem.ood.score_outputs, evaluate_all)
    logit_only: dict[str, Any] = {"needs_grad": False, "reads": frozenset({"logits"})}
    register(
        "logpx",
        logpx,
        **logit_only,
        score_outputs=_logpx,
        description="negative free energy T*logsumexp(f/T) = unnormalised log p(x) (temperature=)",
    )
    register(
        "msp",
        msp,
        **logit_only,
        score_outputs=_msp,
        description="maximum softmax probability of f/T (temperature=)",
    )
    register("max_logit", max_logit, **logit_only, score_outputs=_max_logit, description="largest logit")
    register(
        "grad_norm",
        grad_norm,
        needs_grad=True,
        assumes_jem=True,
        description="-||d log p(x)/dx||_2, JEM's approximate mass (project=)",
    )
    register(
        "grad_norm_projected",
        grad_norm_projected,
        needs_grad=True,
        assumes_jem=True,
        description="grad_norm without components pointing out of the input domain",
    )
    register(
        "logpx_sgld",
        logpx_sgld,
        needs_grad=True,
        assumes_jem=True,
        description="logpx after a few SGLD steps from the input (steps=, step_size=, noise=)",
    )
    register(
        "msp_sgld",
        msp_sgld,
        needs_grad=True,
        assumes_jem=True,
        description="msp after a few SGLD steps from the input (steps=, step_size=, noise=)",
    )
