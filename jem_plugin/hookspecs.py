"""Every hook jem-plugin calls, in one place (pluggy project name ``jem``).

Built-in features register through these same hooks (see :mod:`jem_plugin.plugins`), so a
third-party plugin is a module or object with ``@jem_plugin.hookimpl`` functions, listed in
the ``jem`` entry-point group of its distribution::

    [project.entry-points.jem]
    my_plugin = "my_package.jem_plugin"

Conventions (as in pytest, llm and datasette): ``jem_register_*`` hooks receive a
``register(name, item, **info)`` callback for named things; ``firstresult`` hooks choose one thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("jem")

#: The per-step SGLD hook (the sampler and its CUDA-graph path skip it when nothing implements it).
STEP_HOOK = "jem_sgld_step"


@hookspec(firstresult=True)
def jem_adapter(model: Any, options: dict) -> Any:
    """Return an :class:`jem_plugin.adapter.Adapter` for ``model``, or ``None`` to pass.

    The first non-``None`` answer wins. Plugins registered later are asked first; the
    built-in generic adapter is ``trylast`` so any specific adapter beats it. ``options``
    are the keyword arguments given to :func:`jem_plugin.wrap` (read, do not mutate).
    """


@hookspec
def jem_register_ood_scores(register: Callable[..., None]) -> None:
    """Register OOD scores: ``register(name, item, needs_grad=False, needs_fit=False, description="")``.

    Higher means more in-distribution, always. With ``needs_fit=False`` (the default) ``item``
    is a function ``fn(jm, x, **kwargs) -> Tensor[B]``. With ``needs_fit=True`` it is a detector
    class fitted on in-distribution data: ``item(**kwargs)`` builds a detector with
    ``.fit(jm, data, *, batch_size=256, progress=None) -> self`` (``data`` a DataLoader,
    iterable of batches or tensor; stream over it) and ``.score(jm, x) -> Tensor[B]``;
    :func:`jem_plugin.ood.score` fits it on ``fit_data=`` and :func:`jem_plugin.ood.detector`
    builds one. ``needs_grad=True`` makes :func:`jem_plugin.ood.score` leave autograd on (the
    score takes input gradients). Other keywords are kept as information
    (:func:`jem_plugin.ood.score_info`); the built-ins mark the scores that read ``log p(x)``
    as a trained density with ``assumes_jem=True``.
    """


@hookspec
def jem_register_init_distributions(register: Callable[..., None]) -> None:
    """Register initial distributions for SGLD chains: ``register(name, factory)``.

    ``factory(**kwargs)`` returns an object with ``sample(n, shape, domain, generator, device, y=None)``.
    """


@hookspec
def jem_register_loss_terms(register: Callable[..., None]) -> None:
    """Register extra loss terms for :class:`jem_plugin.JEMLoss`: ``register(name, factory)``.

    ``factory(**kwargs)`` returns a callable ``term(jm, batch) -> (loss Tensor, metrics dict)``.
    """


@hookspec
def jem_sgld_step(state: Any) -> None:
    """Observe or alter each SGLD step.

    Called after every Langevin update with a :class:`jem_plugin.sampling.SGLDStepState`
    (``step``, ``x``, ``grad``, ``step_size``, ``noise``, ``y``, ``sampler``). A plugin may
    replace ``state.x`` (for example to project onto a constraint set). Only called when at
    least one plugin implements it (checked once per chain run), so the hot loop pays nothing
    otherwise.

    The hook is process-global, like every pluggy hook: an implementation sees the steps of
    every sampler in the process (every model, every ``SGLD`` instance, OOD scores that refine
    inputs with SGLD too). To act on one sampler only, compare ``state.sampler`` with it, and
    unregister the plugin when done (:func:`jem_plugin.unregister`), or subclass the sampler and
    override :meth:`~jem_plugin.chains.ChainSampler.after_step`. Not a training hook: training is
    extended with :class:`~jem_plugin.extensions.Extension` objects.
    """
