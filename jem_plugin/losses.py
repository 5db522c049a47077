"""The JEM training objective as a drop-in loss: :class:`JEMLoss`.

(:class:`~jem_plugin.integrations.mixin.GenerativeLossMixin` adds it to a class-based training loop.)

JEM (Grathwohl et al. 2019) trains a classifier ``f`` on

``L = ce_weight * CE(f(x), y)``                                    (p(y|x))
``  + px_weight * [mean E(x_data) - mean E(x_sample)]``            (p(x), E(x) = -logsumexp f(x))
``  + pxy_weight * -[mean f(x_data)[y] - mean f(x_cond)[y]]``      (p(x|y), chains drawn for y)
``  + l2_weight * [mean E(x_data)^2 + mean E(x_sample)^2]``        (energy L2, the authors' fix for divergence)
``  + sum of plugin loss terms``

following the official code (wgrathwohl/JEM, ``train_wrn_ebm.py``): the data batch carries
Gaussian noise of std ``data_noise`` (the reference adds it in its training transform, so the
cross-entropy sees the same noisy batch); the p(x|y) chains are drawn for the batch's own labels
(``sample_q(f, replay_buffer, y=y_lab)``) and contrasted at those labels. The energy L2 term is
the remedy the first author recommends for divergence ("a small l2 penalty on the energy ...
strength around .1", wgrathwohl/JEM#4), in the form of Du & Mordatch (2019).

Speed: the data batch and every sample are pushed through the model in ONE forward on the
concatenated batch (one DDP forward/backward), then split, and every metric is fetched from the
device in one transfer at the end. A step therefore costs sampling plus one forward/backward.
Note that a model with BatchNorm in train mode normalises that concatenated batch with shared
statistics, unless the sampler says the samples pass it on their own (``SGLD(batchnorm="separate")``).

The loss only computes: it is given its sampler and replay buffer, and a call neither builds,
fits nor configures them. What a training loop does around it is explicit:
:meth:`ReplayBuffer.fit <jem_plugin.buffer.ReplayBuffer.fit>` (or
:class:`~jem_plugin.extensions.FitInitFromBatches`) fits an informative init, and
:meth:`JEMLoss.reusing_samples` lets SAM's second pass reuse the first pass's samples.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from . import plugins
from ._checks import (
    DomainCheck,
    check_input,
    check_label_range,
    check_labels,
    draw,
    follow,
    free_energy,
    model_device,
    restore_generator,
)
from .buffer import INIT_HOOK, ReplayBuffer
from .chains import Sampler, label_bound, sample_checked
from .errors import InvalidInputError
from .model import JEM, BatchNormMode, as_jem, check_batchnorm, frozen_bn_stats, sampling_mode
from .sampling import SGLD

__all__ = ["LossOutput", "LossBatch", "JEMLoss", "SampleReplay", "LOSS_TERMS_HOOK"]

LOSS_TERMS_HOOK = "jem_register_loss_terms"


@dataclass
class LossOutput:
    """What :class:`JEMLoss` returns.

    ``loss``: scalar tensor to call ``backward()`` on. ``metrics``: python floats (``loss``,
    ``ce``, ``acc``, ``energy_data``, ``energy_sample``, ``energy_gap`` and the weighted terms in
    use). ``logits``: logits of the (noisy) data batch, attached to the graph, for accuracy or
    other metrics without another forward.
    """

    loss: Tensor
    metrics: dict[str, float]
    logits: Tensor | None = None


@dataclass(frozen=True)
class LossBatch:
    """Everything a plugin loss term sees; tensors are attached to the graph unless noted.

    A term is ``term(jm, batch) -> (loss, metrics)``: ``loss`` a scalar tensor added to the total
    as is (put any weight in the term's own factory arguments), ``metrics`` a dict of floats or
    0-d tensors reported as ``"{name}/{key}"``. Terms must not run extra forwards if they can
    avoid it: the logits of every input are here.

    Fields
    ------
    x, y: the batch as the caller passed it (``x`` without data noise; not in the graph).
    x_data: the data batch as fed to the model (``x`` plus data noise).
    logits_data: ``f(x_data)``, ``[B, K]``.
    energy_data: ``E(x_data) = -logsumexp f(x_data)``, ``[B]``.
    x_sample, logits_sample, energy_sample: the p(x) chains (``None`` without a p(x) term).
    y_sample: the labels the p(x) chains were drawn for (``class_conditional_px=True``), else ``None``.
    x_cond, logits_cond, y_cond: the p(x|y) chains and their labels (``None`` without a p(x|y) term).
    """

    x: Tensor
    y: Tensor
    x_data: Tensor
    logits_data: Tensor
    energy_data: Tensor
    x_sample: Tensor | None = None
    logits_sample: Tensor | None = None
    energy_sample: Tensor | None = None
    y_sample: Tensor | None = None
    x_cond: Tensor | None = None
    logits_cond: Tensor | None = None
    y_cond: Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def sample_energies(self) -> Tensor | None:
        """Marginal energies of every sampled input (p(x) and p(x|y) chains), or ``None``."""
        cond = free_energy(self.logits_cond) if self.logits_cond is not None else None
        parts = [e for e in (self.energy_sample, cond) if e is not None]
        return torch.cat(parts) if parts else None


def _batch_statistics_in_use(model: nn.Module) -> bool:
    """Whether some BatchNorm layer normalises with batch statistics now: only then does a
    separate samples' pass differ from the joint one (a model without them keeps one forward)."""
    return any(isinstance(m, _NormBase) and (m.training or not m.track_running_stats) for m in model.modules())


def _samples_pass(core: JEM, x: Tensor) -> Tensor:
    with frozen_bn_stats(core.model):
        return core(x)


class SampleReplay:
    """What :meth:`JEMLoss.reusing_samples` yields: the samples the first forward in the block
    drew (with their labels), which every later forward in the block reuses in order.

    ``replaying`` turns ``True`` after the first forward (set it yourself to replay earlier, as
    loops written for :func:`jem_plugin.sam.reuse_samples` do between SAM's two passes)."""

    def __init__(self) -> None:
        self.draws: list[tuple[Tensor, Tensor | None]] = []
        self.replaying = False
        self._next = 0

    def _take(self) -> tuple[Tensor, Tensor | None]:
        if self._next >= len(self.draws):
            raise RuntimeError(
                "a forward that reuses samples asked for more samples than the first forward drew; "
                "the closure must compute the same loss both times"
            )
        self._next += 1
        return self.draws[self._next - 1]

    def __repr__(self) -> str:
        return f"SampleReplay(draws={len(self.draws)}, replaying={self.replaying})"


class JEMLoss(nn.Module):
    """JEM's objective: cross-entropy plus the energy contrast of data against SGLD samples.

    Parameters
    ----------
    sampler: a :class:`~jem_plugin.chains.Sampler`: :class:`~jem_plugin.sampling.SGLD` (default
        ``SGLD()`` with the paper's settings: 20 steps, step size 1, noise 0.01),
        :class:`~jem_plugin.builtins.pgd_negatives.PGDNegatives`, any
        :class:`~jem_plugin.chains.ChainSampler`, or an object with ``sample(jm, n, buffer=, y=)``
        and ``sample(jm, x_init=, y=)``. Its ``batchnorm`` also says how the samples pass the
        model's BatchNorm layers in train mode in the loss's forward (:attr:`batchnorm`), and its
        ``clamp`` whether the data noise stays inside the input domain (:meth:`clamps_data`).
    buffer: the :class:`~jem_plugin.buffer.ReplayBuffer` the chains start from and are written
        back to, e.g. ``ReplayBuffer(10000, sample_shape=(3, 32, 32))`` (class-conditional,
        ``num_classes=K``, when ``pxy_weight > 0`` or ``class_conditional_px``), or
        ``ReplayBuffer.for_model(jm)``, or a recipe's ``build``. Its init is fitted by you
        (``buffer.fit(x, y)``) or by :class:`~jem_plugin.extensions.FitInitFromBatches`. The buffer
        is a submodule: it is saved in ``JEMLoss.state_dict()``, and it moves to the model's device
        on first use (a buffer given, or restored from a checkpoint, on the CPU joins the chains on
        the GPU: no host-device copy per iteration). A loss whose terms draw samples needs one.
    ce_weight, px_weight, pxy_weight, l2_weight: weights of the p(y|x), p(x), p(x|y) and
        energy-L2 terms (paper: 1, 1, 0, 0; try ``l2_weight=0.1`` .. ``1`` if training diverges).
    data_noise: std of the Gaussian noise added to the data batch (paper: 0.03). It is kept inside
        the model's input domain exactly when the sampler clamps its chains (a value already
        outside it keeps its clean value as the bound). Why: with clamped chains and unclamped
        data noise, the positive phase has mass just outside the domain (saturated pixels +
        noise) that the negative phase can never reach, so training keeps raising the density
        *outside* the domain; the input gradient of real data then points out of it at every
        saturated pixel and swamps the gradient-norm OOD score.
    n_samples: number of chains per sampled term and step (default: the batch size); the p(x|y)
        chains are drawn for the first ``n_samples`` labels of the batch.
    class_conditional_px: draw the p(x) chains from p(y)p(x|y) with uniformly random ``y`` (the
        reference's ``--class_cond_p_x_sample``: better samples, slightly lower accuracy).
    generator: a ``torch.Generator`` for the data noise and random labels (default: global RNG).

    Extra loss terms registered through the ``jem_register_loss_terms`` hook are added with
    :meth:`add_term`, e.g. ``loss_fn.add_term("energy_bounded", outliers="uniform")`` (the energy L2
    regulariser is ``l2_weight``, not a term). :attr:`validate` (default ``True``) checks shapes,
    dtypes and the label range of every batch (one small device sync on a GPU); set it to
    ``False`` in a loop whose data you trust.

    ``loss_fn(jm, x, y)`` returns a :class:`LossOutput`. ``jm`` is ``jem_plugin.wrap(model)``, or a
    ``DistributedDataParallel`` around it: samples are drawn on the bare module, the concatenated
    batch goes through the wrapper once.
    """

    # A ReplayBuffer, or a user's module with its sample(n, domain=, y=, generator=) and update(idx, x).
    buffer: Any

    def __init__(
        self,
        sampler: Sampler | None = None,
        buffer: nn.Module | None = None,
        *,
        ce_weight: float = 1.0,
        px_weight: float = 1.0,
        pxy_weight: float = 0.0,
        l2_weight: float = 0.0,
        data_noise: float = 0.03,
        n_samples: int | None = None,
        class_conditional_px: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("ce_weight", ce_weight),
            ("px_weight", px_weight),
            ("pxy_weight", pxy_weight),
            ("l2_weight", l2_weight),
            ("data_noise", data_noise),
        ):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if n_samples is not None and (isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1):
            raise ValueError(f"n_samples must be a positive int or None, got {n_samples!r}")
        self.sampler = sampler if sampler is not None else SGLD()
        self.buffer = buffer
        self.ce_weight = float(ce_weight)
        self.px_weight = float(px_weight)
        self.pxy_weight = float(pxy_weight)
        self.l2_weight = float(l2_weight)
        self.data_noise = float(data_noise)
        self.n_samples = n_samples
        self.class_conditional_px = bool(class_conditional_px)
        self.generator = generator
        self.validate = True  # check shapes, dtypes and label range (one small device sync on a GPU)
        self.terms = nn.ModuleDict()
        self._plain_terms: dict[str, Callable] = {}
        self._term_kwargs: dict[str, dict[str, Any]] = {}  # what add_term built each term from
        self._domain_check = DomainCheck()  # warns once when the data leave the model's domain
        self._replay: SampleReplay | None = None  # set inside reusing_samples()
        coarse = getattr(getattr(buffer, "init_dist", None), "coarse", 0.0)
        if coarse and self.l2_weight == 0 and (self.px_weight > 0 or self.pxy_weight > 0):
            # Chains that stay at flat images are negatives the energy tells apart with no limit:
            # on the long row, wrn10-1 (no normalisation) diverged to energies of 1e10 by 288
            # iterations without the L2, and within +-1 with it at 0.1 (benchmarks/check_coarse_energy.py).
            warnings.warn(
                f"the buffer starts {coarse:.0%} of its chains from coarse images and l2_weight is 0: the energy "
                "of chains that stay at flat images can grow without bound; set l2_weight (the recipes' 0.1)",
                UserWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------ configuration
    @property
    def sampler(self) -> Sampler:
        """The sampler. A plain object (``SGLD``) is not a submodule: its state travels through
        ``get_extra_state``. An ``nn.Module`` sampler is an ordinary submodule (``nn.Module``'s rule;
        ``del loss_fn.sampler`` before replacing it with a plain object)."""
        module = self._modules.get("sampler")
        return cast(Sampler, module) if module is not None else self.__dict__["_sampler"]

    @sampler.setter
    def sampler(self, value: Sampler) -> None:  # reached for non-Module values only (nn.Module.__setattr__)
        self._modules.pop("sampler", None)
        self.__dict__["_sampler"] = value

    @property
    def batchnorm(self) -> BatchNormMode:
        """How the samples pass the model's BatchNorm layers in train mode, read from the sampler's
        ``batchnorm``. ``"joint"``: one forward over data and samples, normalised with shared batch
        statistics that also enter the running statistics. ``"separate"``: the samples in a second
        forward with their own batch statistics, leaving the running statistics to the data
        (JEM++'s passes; the chains then climb the energy this trains). No effect on models
        without BatchNorm. A sampler that does not say is ``"joint"``."""
        # A sampler need not say (the contract, chains.Sampler): one that does not is "joint".
        return check_batchnorm(
            getattr(self.sampler, "batchnorm", "joint"), "the sampler's batchnorm", error=InvalidInputError
        )

    def clamps_data(self) -> bool:
        """Whether the data noise is kept inside the model's input domain: when the sampler
        clamps its chains (``SGLD(clamp=True)``, the default)."""
        return bool(getattr(self.sampler, "clamp", False))  # a sampler that does not say does not clamp

    def add_term(self, name: str, **kwargs: Any) -> Callable:
        """Add the loss term ``name`` from the ``jem_register_loss_terms`` hook; returns it."""
        factory = plugins.lookup(LOSS_TERMS_HOOK, name, "loss term")["item"]
        term = factory(**kwargs)
        self._term_kwargs[name] = dict(kwargs)
        if isinstance(term, nn.Module):
            self.terms[name] = term  # its parameters/buffers are saved with the loss
        else:
            self._plain_terms[name] = term
        return term

    def _all_terms(self) -> list[tuple[str, Callable]]:
        return list(self.terms.items()) + list(self._plain_terms.items())

    @property
    def samples_needed(self) -> bool:
        """True when a step draws SGLD samples (p(x) or p(x|y) on, or a term asking for samples)."""
        return (
            self.px_weight > 0
            or self.pxy_weight > 0
            # Terms come from plugins: a term that draws nothing need not say so.
            or any(getattr(t, "needs_samples", False) for _, t in self._all_terms())
        )

    @property
    def class_conditional(self) -> bool:
        """Whether the chains are drawn per class (the buffer then needs ``num_classes``)."""
        return self.pxy_weight > 0 or self.class_conditional_px

    @contextlib.contextmanager
    def reusing_samples(self) -> Iterator[SampleReplay]:
        """Draw once for several forwards: in the block, the first forward records its samples and
        every later one reuses them, in order, without drawing or writing the buffer (SAM's second
        pass, at the perturbed weights, on the same batch; :class:`~jem_plugin.sam.SAM` ``.step``
        uses this when given ``loss_fn=``). Yields the :class:`SampleReplay`.

        >>> with loss_fn.reusing_samples():
        ...     first = loss_fn(jm, x, y)     # draws and records
        ...     second = loss_fn(jm, x, y)    # the same samples
        """
        if self._replay is not None:
            raise RuntimeError("JEMLoss.reusing_samples() blocks do not nest")
        self._replay = replay = SampleReplay()
        try:
            yield replay
        finally:
            self._replay = None

    def extra_repr(self) -> str:
        return (
            f"ce_weight={self.ce_weight}, px_weight={self.px_weight}, pxy_weight={self.pxy_weight}, "
            f"l2_weight={self.l2_weight}, data_noise={self.data_noise}, n_samples={self.n_samples}, "
            f"class_conditional_px={self.class_conditional_px}, batchnorm={self.batchnorm!r} (the sampler's), "
            f"clamp_data={self.clamps_data()}, sampler={self.sampler!r}"
        )

    # ------------------------------------------------------------------ checks
    def _check_batch(self, core: JEM, x: Tensor, y: Any) -> Tensor:
        """``y`` checked against the (already checked) inputs ``x``, the model's classes and the
        replay buffer: the one check the labels get on their way to the chains drawn for them."""
        buffer = self.buffer
        if buffer is not None and tuple(x.shape[1:]) != tuple(buffer.sample_shape):
            raise InvalidInputError(
                f"inputs of shape {tuple(x.shape[1:])} do not match the replay buffer's sample_shape "
                f"{tuple(buffer.sample_shape)}; create the buffer with "
                f"ReplayBuffer(sample_shape={tuple(x.shape[1:])})"
            )
        k, kb = core.num_classes, getattr(buffer, "num_classes", None)
        if self.class_conditional and k is not None and kb is not None and kb < k:
            raise InvalidInputError(
                f"the replay buffer holds chains for {kb} classes and the model has {k}; create it with "
                f"ReplayBuffer(..., num_classes={k})"
            )
        # The chains for y index the buffer's class segments before the model's first forward.
        bound = label_bound(core, buffer if self.class_conditional else None)
        return check_labels(y, x.shape[0], num_classes=bound, device=x.device)

    def _num_classes(self, core: JEM, x: Tensor) -> int:
        k = core.num_classes
        if k is None:
            # Unknown until the first forward: one eval-mode, no-grad forward of one input, once.
            with torch.no_grad(), sampling_mode(core):
                k = int(core(x[:1]).shape[1])
            core.settle(num_classes=k)
        return k

    # ------------------------------------------------------------------ the loss
    @staticmethod
    def _clamp_noisy(core: JEM, x: Tensor, x_noisy: Tensor) -> Tensor:
        """Keep the noise from pushing values out of the domain. Values the data itself has
        outside the domain (a mis-set domain) stay reachable: the bound there is the clean value,
        so the classifier never trains on silently clipped data."""
        lo, hi = core.domain.bounds(x)
        return torch.minimum(torch.maximum(x_noisy, torch.minimum(lo, x)), torch.maximum(hi, x))

    def _with_data_noise(self, core: JEM, x: Tensor) -> Tensor:
        """``x`` plus the data noise, kept inside the domain the chains are clamped to."""
        if self.data_noise <= 0:
            return x
        noisy = x + self.data_noise * self._noise_like(x)
        return self._clamp_noisy(core, x, noisy) if self.clamps_data() else noisy

    def _noise_like(self, x: Tensor) -> Tensor:
        return draw(torch.randn, x.shape, self.generator, x.device, dtype=x.dtype)

    def _random_labels(self, n: int, k: int, device) -> Tensor:
        return draw(lambda size, **kw: torch.randint(0, k, size, **kw), (n,), self.generator, device)

    def _sample(self, core: JEM, n: int, buffer: Any, y: Tensor | None, evaluating: bool) -> Tensor:
        # Validation reads the buffer (starts drawn with the loss's generator) and never writes it.
        x_init = None
        if evaluating and isinstance(buffer, ReplayBuffer):
            buffer = buffer.read_only(self.generator)
        elif evaluating:  # a user's buffer: its starts, chains run from them
            device = model_device(core)
            x0, _ = buffer.sample(n, domain=core.domain, y=y, generator=self.generator)
            buffer, x_init = None, x0.to(device or x0.device)
        return sample_checked(self.sampler, core, n, buffer, y, x_init)  # forward checked the batch and labels

    def _draw(
        self, core: JEM, x: Tensor, y: Tensor, evaluating: bool
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
        """``(x_sample, y_sample, x_cond, y_cond)``: the p(x) and p(x|y) chains and their labels
        (``None`` where a term is off), drawn, or reused inside :meth:`reusing_samples`."""
        replay = self._replay
        replaying = replay is not None and replay.replaying
        buffer = self.buffer
        if buffer is None:
            cond = ", class_conditional=True" if self.class_conditional else ""
            raise InvalidInputError(
                f"JEMLoss draws samples and needs a replay buffer: JEMLoss(sampler, "
                f"ReplayBuffer.for_model(jm{cond})), or use a recipe's build"
            )
        follow(buffer, model_device(core, x.device))  # a buffer given or restored on the CPU
        x_sample = y_sample = x_cond = y_cond = None
        n = self.n_samples or x.shape[0]
        if self.px_weight > 0 or not self.pxy_weight > 0:
            if replay is not None and replaying:
                x_sample, y_sample = replay._take()
            else:
                if self.class_conditional_px:
                    y_sample = self._random_labels(n, self._num_classes(core, x), x.device)
                x_sample = self._sample(core, n, buffer, y_sample, evaluating)
                if replay is not None:
                    replay.draws.append((x_sample, y_sample))
        if self.pxy_weight > 0:
            y_cond = y if n >= x.shape[0] else y[:n]
            if replay is not None and replaying:
                x_cond, _ = replay._take()
            else:
                x_cond = self._sample(core, y_cond.shape[0], buffer, y_cond, evaluating)
                if replay is not None:
                    replay.draws.append((x_cond, y_cond))
        return x_sample, y_sample, x_cond, y_cond

    def forward(self, jm: Any, x: Tensor, y: Tensor, px_data: Tensor | None = None) -> LossOutput:
        """One JEM loss evaluation: samples, one forward on the concatenated batch, the terms.

        ``px_data``: the data the p(x) and energy-L2 terms contrast with the samples (SADA-JEM:
        the un-augmented batch, while cross-entropy gets the augmented ``x``); default ``x``.

        Validation: with the loss module in eval mode (``loss_fn.eval()``) or with gradients off
        (``torch.no_grad()``, ``torch.inference_mode()``) the replay buffer is read but never
        written, and the data carries no noise; the result then depends only on the model, the
        batch and the generators (the loss's ``generator`` and the sampler's).
        """
        core = as_jem(jm, "JEMLoss")  # the JEM inside compile/DDP/DataParallel/FSDP wrappers
        # 1. The batch: the shared input check (floats cast to the parameters' dtype), the labels.
        x = check_input(x, dtype=core.param_dtype(), domain=core.domain)
        self._domain_check(x, core.domain, "JEMLoss", stacklevel=4)
        evaluating = not self.training or not torch.is_grad_enabled()  # no buffer write, no data noise
        y = self._check_batch(core, x, y) if self.validate else y.to(device=x.device, dtype=torch.long)
        replay = self._replay
        if replay is not None:
            replay._next = 0

        # 2. Samples (detached fp32; the sampler handles eval mode and parameter grads).
        x_sample = y_sample = x_cond = y_cond = None
        if self.samples_needed:
            x_sample, y_sample, x_cond, y_cond = self._draw(core, x, y, evaluating)
        if replay is not None:
            replay.replaying = True

        # 3. Data noise, then one forward on [x_data; px_data; x_sample; x_cond], then split.
        x_data = x if evaluating else self._with_data_noise(core, x)
        if px_data is not None:
            px_data = check_input(px_data, dtype=core.param_dtype(), domain=core.domain, what="px_data")
            px_data = px_data if evaluating else self._with_data_noise(core, px_data)
        parts = [x_data] + [t.to(x_data.dtype) for t in (px_data, x_sample, x_cond) if t is not None]
        n_data = 1 + (px_data is not None)
        if self.batchnorm == "separate" and len(parts) > n_data and _batch_statistics_in_use(core.model):
            # Data first (through the wrapper: DDP's reducer sees one forward), then the samples
            # through the bare JEM with their own batch statistics, the running ones untouched.
            logits_all = torch.cat([jm(torch.cat(parts[:n_data])), _samples_pass(core, torch.cat(parts[n_data:]))])
        else:
            logits_all = jm(torch.cat(parts) if len(parts) > 1 else x_data)
        sizes = [p.shape[0] for p in parts]
        if logits_all.dim() != 2 or logits_all.shape[0] != sum(sizes):
            raise InvalidInputError(
                f"the model returned shape {tuple(logits_all.shape)} for a batch of {sum(sizes)} "
                "inputs; JEMLoss needs [B, K] logits (see wrap(model, logits=...))"
            )
        if core.num_classes is None:
            num_classes = int(logits_all.shape[1])
            core.settle(num_classes=num_classes)
            if self.validate:  # the label range could not be checked before the first forward
                check_label_range(y, num_classes)
        chunks = list(torch.split(logits_all, sizes))
        logits_data = chunks.pop(0)
        energy_px = free_energy(chunks.pop(0)) if px_data is not None else None
        logits_sample = chunks.pop(0) if x_sample is not None else None
        logits_cond = chunks.pop(0) if x_cond is not None else None

        # 4. Terms. Metrics stay tensors until the single transfer at the end.
        energy_data = free_energy(logits_data)
        metrics: dict[str, Tensor] = {}
        ce = F.cross_entropy(logits_data, y)
        loss = self.ce_weight * ce
        metrics["ce"] = ce
        metrics["acc"] = (logits_data.argmax(1) == y).float().mean()
        metrics["energy_data"] = energy_data.mean()

        energy_sample = free_energy(logits_sample) if logits_sample is not None else None
        if energy_sample is not None:
            # -(mean f(x_data) - mean f(x_q)) with f = logsumexp, exactly the reference's l_p_x.
            px = (energy_data if energy_px is None else energy_px).mean() - energy_sample.mean()
            if self.px_weight > 0:
                loss = loss + self.px_weight * px
            metrics["px"] = px
        if logits_cond is not None:
            assert y_cond is not None  # drawn together with x_cond
            m = y_cond.shape[0]  # the chains were drawn for the first m labels (all by default)
            fp = logits_data[:m].gather(1, y_cond.unsqueeze(1)).mean()
            fq = logits_cond.gather(1, y_cond.unsqueeze(1)).mean()
            pxy = -(fp - fq)
            loss = loss + self.pxy_weight * pxy
            metrics["pxy"] = pxy

        core.trained_px = True if not evaluating and (self.px_weight > 0 or self.pxy_weight > 0) else core.trained_px
        batch = LossBatch(
            x=x,
            y=y,
            x_data=x_data,
            logits_data=logits_data,
            energy_data=energy_data,
            x_sample=x_sample,
            logits_sample=logits_sample,
            energy_sample=energy_sample,
            y_sample=y_sample,
            x_cond=x_cond,
            logits_cond=logits_cond,
            y_cond=y_cond,
        )
        all_sample_energies = batch.sample_energies
        if all_sample_energies is not None:
            metrics["energy_sample"] = all_sample_energies.mean()
            metrics["energy_gap"] = metrics["energy_sample"] - metrics["energy_data"]
        if self.l2_weight > 0:
            l2 = (energy_data if energy_px is None else energy_px).pow(2).mean()
            if all_sample_energies is not None:
                l2 = l2 + all_sample_energies.pow(2).mean()
            loss = loss + self.l2_weight * l2
            metrics["l2"] = l2

        for name, term in self._all_terms():
            t_loss, t_metrics = term(core, batch)
            loss = loss + t_loss
            metrics[name] = t_loss
            for key, value in (t_metrics or {}).items():
                metrics[f"{name}/{key}"] = value
        metrics = {"loss": loss, **metrics}
        return LossOutput(loss=loss, metrics=_to_floats(metrics), logits=logits_data)

    # ------------------------------------------------------------------ state
    def get_extra_state(self) -> dict[str, Any]:
        # Every constructor argument travels: the settings as values, the sampler and generator as
        # their state, the buffer as the arguments that rebuild it (so the state loads into a
        # JEMLoss built without one, e.g. Lightning's load_from_checkpoint(ck, model=...)), the
        # terms as the arguments they were built from.
        config = {name: getattr(self, name) for name in _SETTINGS}
        state: dict[str, Any] = {
            "config": config,
            "buffer_config": _buffer_config(self.buffer),
            "term_kwargs": {name: kw for name, kw in self._term_kwargs.items() if _is_plain(kw)},
        }
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
            state["generator_device"] = str(self.generator.device)
        if isinstance(self.sampler, _Stateful) and not isinstance(self.sampler, nn.Module):
            state["sampler"] = self.sampler.state_dict()  # a Module sampler is saved as a child
        plain: dict[str, Any] = {}
        for name, term in self._plain_terms.items():
            if isinstance(term, _Stateful):
                plain[name] = term.state_dict()
        if plain:
            state["terms"] = plain
        return state

    def set_extra_state(self, state: dict[str, Any]) -> None:
        # Runs before the children are loaded: a buffer or term this loss lacks is created here
        # from its arguments, so a fresh JEMLoss resumes from a checkpoint.
        for name, value in state.get("config", {}).items():
            if name in _SETTINGS:
                setattr(self, name, value)
        config = state.get("buffer_config")
        if config is not None and self.buffer is None:
            self.buffer = ReplayBuffer.from_config(config)
        for name, kwargs in state.get("term_kwargs", {}).items():
            if name not in self._term_kwargs:
                self.add_term(name, **kwargs)
        if state.get("generator") is not None:
            self.generator = restore_generator(
                self.generator, state["generator"], state.get("generator_device"), "JEMLoss"
            )
        if "sampler" in state and isinstance(self.sampler, _Stateful):
            self.sampler.load_state_dict(state["sampler"])
        for name, term_state in state.get("terms", {}).items():
            term = self._plain_terms.get(name)
            if isinstance(term, _Stateful):
                term.load_state_dict(term_state)


@runtime_checkable
class _Stateful(Protocol):
    """A plain (non-Module) loss term that carries state of its own."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _is_plain(value: Any) -> bool:
    """Data a ``weights_only`` checkpoint can hold: numbers, strings, None, and containers of them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def _buffer_config(buffer: Any) -> dict[str, Any] | None:
    """The constructor arguments that rebuild ``buffer`` (a ReplayBuffer with a registered init)."""
    if not isinstance(buffer, ReplayBuffer) or buffer.init_name not in plugins.collect(INIT_HOOK):
        return None
    return buffer.config()


# The settings a checkpoint carries as values: every named constructor argument but the
# collaborators (sampler, buffer, generator and terms travel as their own state), read from the
# signature so that a new argument cannot be left out.
_SETTINGS: tuple[str, ...] = tuple(
    name
    for name in inspect.signature(JEMLoss.__init__).parameters
    if name not in ("self", "sampler", "buffer", "generator")
)


def _to_floats(metrics: dict[str, Any]) -> dict[str, float]:
    """Every metric as a python float with ONE device-to-host transfer."""
    names, tensors, floats = [], [], {}
    for key, value in metrics.items():
        if isinstance(value, Tensor):
            names.append(key)
            tensors.append(value.detach().reshape(()).float())
        else:
            floats[key] = float(value)
    if tensors:
        values = torch.stack([t.to(tensors[0].device) for t in tensors]).tolist()
        floats.update(zip(names, values))
    return {k: floats[k] for k in metrics}
