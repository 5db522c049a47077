"""The recipe tree: the frozen settings of one JEM run (:class:`Recipe` and its sections), what
:meth:`Recipe.build` returns (:class:`JEMSetup`), and the tree's flat names (:func:`flat_names`).
Public through :mod:`jem_plugin.recipes`."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from .._checks import unpack_batch
from .._config_tree import ConfigTree
from ..buffer import ReplayBuffer
from ..covariance import COVARIANCE_KINDS, Stationary
from ..errors import InvalidInputError, UnknownNameError
from ..extensions import Extension, RecomputeBatchNorm, SharpnessAware
from ..inits import INIT_SPECS, Gaussian, InitSpec, Uniform
from ..losses import JEMLoss
from ..sampling import BATCHNORM_MODES, COLOURS, SGLD
from ..schedules import Poly


def _meta(help: str, flag: str | None = None) -> dict[str, Any]:
    """Field metadata: the help text of its flag, and the flat name when it is not ``prefix_field``."""
    return {"help": help, **({"flag": flag} if flag else {})}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidInputError(message)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------------------- the pieces
@dataclass(frozen=True)
class SamplerConfig:
    """SGLD: steps, step size (a number or a :class:`~jem_plugin.schedules.Poly` schedule), noise,
    the elementwise gradient clamp, whether chains stay in the input domain, how samples pass
    BatchNorm, which colour axes steps move."""

    steps: int = field(default=20, metadata=_meta("SGLD steps per chain"))
    step_size: float | Poly = field(default=1.0, metadata=_meta("SGLD step size"))
    noise: float = field(default=0.01, metadata=_meta("standard deviation of the SGLD noise"))
    grad_clamp: float | None = field(
        default=None, metadata=_meta("clamp each SGLD gradient elementwise to [-c, c] (JEM++'s proximal SGLD)")
    )
    clamp: bool = field(default=True, metadata=_meta("keep the chains inside the model's input domain"))
    batchnorm: Literal["joint", "separate"] = field(
        default="joint",
        metadata=_meta(
            "samples pass BatchNorm with the data and chains see running statistics (joint), or samples "
            "and chains are normalised by their own batch statistics (separate; fast's)"
        ),
    )
    colours: Literal["all", "data"] = field(
        default="all",
        metadata=_meta(
            "SGLD steps move every channel (all) or only the colour axes the data vary along (data: grey "
            "images stay grey in an RGB model)"
        ),
    )

    def __post_init__(self) -> None:
        _check(_count(self.steps) and self.steps >= 0, f"sampler steps must be an int >= 0, got {self.steps!r}")
        _check(
            isinstance(self.step_size, Poly) or (_number(self.step_size) and self.step_size > 0),
            f"sampler step_size must be a number > 0 or a Poly schedule, got {self.step_size!r}",
        )
        _check(_number(self.noise) and self.noise >= 0, f"sampler noise must be a number >= 0, got {self.noise!r}")
        _check(
            self.grad_clamp is None or (_number(self.grad_clamp) and self.grad_clamp > 0),
            f"sampler grad_clamp must be a number > 0 or None, got {self.grad_clamp!r}",
        )
        _check(
            self.batchnorm in BATCHNORM_MODES,
            f"sampler batchnorm must be one of {BATCHNORM_MODES}, got {self.batchnorm!r}",
        )
        _check(self.colours in COLOURS, f"sampler colours must be one of {COLOURS}, got {self.colours!r}")

    def build(self, generator: torch.Generator | None = None) -> SGLD:
        """The :class:`~jem_plugin.SGLD` these settings describe."""
        return SGLD(
            steps=self.steps,
            step_size=self.step_size,
            noise=self.noise,
            grad_clamp=self.grad_clamp,
            clamp=self.clamp,
            batchnorm=self.batchnorm,
            colours=self.colours,
            generator=generator,
        )


@dataclass(frozen=True)
class BufferConfig:
    """The replay buffer: its size (at most ``capacity`` slots; with ``visits``, few enough that
    each is drawn about that often in the run), how often a drawn slot restarts from the init,
    and the init distribution chains start from."""

    capacity: int = field(default=10000, metadata=_meta("replay-buffer slots (at most, with --buffer-visits)"))
    visits: float | None = field(
        default=None,
        metadata=_meta(
            "size the buffer so each slot is drawn about this many times in the run, at most --buffer-capacity: "
            "a chain drawn only a few times stays near its init"
        ),
    )
    reinit_freq: float = field(
        default=0.05,
        metadata=_meta(
            "a drawn slot restarts from the init with this probability (its chains are then about "
            "1 / reinit_freq draws old, however long the run)"
        ),
    )
    init: InitSpec = field(
        default_factory=Uniform,
        metadata=_meta("the init distribution chains start from (gaussian: per class, fitted from the data)", "init"),
    )

    def __post_init__(self) -> None:
        _check(
            _count(self.capacity) and self.capacity >= 1, f"buffer capacity must be an int >= 1, got {self.capacity!r}"
        )
        _check(
            self.visits is None or (_number(self.visits) and self.visits > 0),
            f"buffer visits must be a number > 0 or None, got {self.visits!r}",
        )
        _check(
            _number(self.reinit_freq) and 0 <= self.reinit_freq <= 1,
            f"buffer reinit_freq must be in [0, 1], got {self.reinit_freq!r}",
        )

    def capacity_for(self, total_iters: int | None, chains: int | None) -> int:
        """Slots for a run of ``total_iters`` iterations of ``chains`` chains each: ``capacity``, or
        with ``visits`` set, few enough that each slot is drawn about ``visits`` times (never fewer
        than the chains of one iteration)."""
        if self.visits is None or not total_iters or not chains:
            return self.capacity
        return min(self.capacity, max(chains, int(total_iters * chains / self.visits)))


@dataclass(frozen=True)
class LossConfig:
    """The weights of JEM's terms, the data noise, and which chains the p(x) term draws."""

    ce_weight: float = field(default=1.0, metadata=_meta("weight of the cross-entropy (p(y|x)) term"))
    px_weight: float = field(default=1.0, metadata=_meta("weight of the p(x) term"))
    pxy_weight: float = field(default=0.0, metadata=_meta("weight of the p(x|y) term"))
    l2_weight: float = field(default=0.0, metadata=_meta("weight of the energy L2 on data and sample energies"))
    data_noise: float = field(default=0.03, metadata=_meta("std of the Gaussian noise on the data batch"))
    n_samples: int | None = field(default=None, metadata=_meta("SGLD chains per iteration (default: the batch size)"))
    class_conditional_px: bool = field(
        default=False, metadata=_meta("p(x) chains drawn from p(y) p(x|y): one class per chain and buffer slot")
    )
    px_clean_data: bool = field(
        default=False,
        metadata=_meta(
            "the p(x) term sees the un-augmented batch (SADA-JEM): a loop that augments passes it as px_data="
        ),
    )

    def __post_init__(self) -> None:
        for name in ("ce_weight", "px_weight", "pxy_weight", "l2_weight", "data_noise"):
            value = getattr(self, name)
            _check(_number(value) and value >= 0, f"loss {name} must be a finite number >= 0, got {value!r}")
        _check(
            self.n_samples is None or (_count(self.n_samples) and self.n_samples >= 1),
            f"loss n_samples must be an int >= 1 or None, got {self.n_samples!r}",
        )

    def build(self, sampler: SGLD, buffer: ReplayBuffer, generator: torch.Generator | None = None) -> JEMLoss:
        """The :class:`~jem_plugin.JEMLoss` over ``sampler`` and ``buffer`` with these weights."""
        return JEMLoss(
            sampler,
            buffer,
            ce_weight=self.ce_weight,
            px_weight=self.px_weight,
            pxy_weight=self.pxy_weight,
            l2_weight=self.l2_weight,
            data_noise=self.data_noise,
            n_samples=self.n_samples,
            class_conditional_px=self.class_conditional_px,
            generator=generator,
        )


@dataclass(frozen=True)
class OptimConfig:
    """The optimiser, its linear warm-up (capped to a share of the run) and the gradient-norm clip."""

    optimizer: Literal["adam", "sgd"] = field(default="adam", metadata=_meta("adam, or sgd with momentum 0.9"))
    lr: float = field(default=1e-4, metadata=_meta("learning rate"))
    weight_decay: float = field(default=0.0, metadata=_meta("weight decay"))
    warmup_iters: int = field(default=1000, metadata=_meta("linear warm-up iterations (capped, below)"))
    warmup_max_fraction: float = field(
        default=0.1, metadata=_meta("the warm-up never exceeds this share of the run's iterations")
    )
    max_grad_norm: float | None = field(
        default=None, metadata=_meta("clip the gradient norm of each optimiser step (None: no clip)")
    )

    def __post_init__(self) -> None:
        _check(_number(self.lr) and self.lr > 0, f"optim lr must be a number > 0, got {self.lr!r}")
        _check(
            _number(self.weight_decay) and self.weight_decay >= 0,
            f"optim weight_decay must be >= 0, got {self.weight_decay!r}",
        )
        _check(
            _count(self.warmup_iters) and self.warmup_iters >= 0,
            f"optim warmup_iters must be an int >= 0, got {self.warmup_iters!r}",
        )
        _check(
            _number(self.warmup_max_fraction) and 0 <= self.warmup_max_fraction <= 1,
            f"optim warmup_max_fraction must be in [0, 1], got {self.warmup_max_fraction!r}",
        )
        _check(
            self.max_grad_norm is None or (_number(self.max_grad_norm) and self.max_grad_norm > 0),
            f"optim max_grad_norm must be a number > 0 or None, got {self.max_grad_norm!r}",
        )

    def warmup_for(self, total_iters: int | None) -> int:
        """Warm-up iterations for a run of ``total_iters``: ``warmup_iters``, capped to
        ``warmup_max_fraction`` of the run (uncapped when the length is unknown)."""
        if not total_iters:
            return self.warmup_iters
        return max(0, min(self.warmup_iters, int(self.warmup_max_fraction * total_iters)))

    def build(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimiser over ``params``."""
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9, weight_decay=self.weight_decay)
        raise UnknownNameError(f"unknown optimizer {self.optimizer!r}; use 'adam' or 'sgd'")


@dataclass(frozen=True)
class SAMConfig:
    """Sharpness-aware minimisation (SADA-JEM: rho 2, adaptive); ``rho=None`` leaves it out."""

    rho: float | None = field(default=None, metadata=_meta("sharpness-aware minimisation radius (None: no SAM)"))
    adaptive: bool = field(default=True, metadata=_meta("ASAM's scale-invariant neighbourhood"))

    def __post_init__(self) -> None:
        _check(
            self.rho is None or (_number(self.rho) and self.rho > 0),
            f"sam rho must be a number > 0 or None, got {self.rho!r}",
        )


# ---------------------------------------------------------------------------- what build returns
@dataclass
class JEMSetup:
    """The explicit objects a :class:`Recipe` builds for one model and run (:meth:`Recipe.build`).

    Use them in your own loop (``out = setup.loss(jm, x, y)``; ``out.loss.backward()``;
    ``setup.optimizer.step()``; call each extension's hooks where its docstring says), or pass the
    whole setup to :func:`jem_plugin.training.fit`, which runs the extensions and the warm-up.
    """

    recipe: Recipe
    sampler: SGLD
    buffer: ReplayBuffer
    loss: JEMLoss
    optimizer: torch.optim.Optimizer
    extensions: list[Extension]
    warmup_iters: int
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- the recipe
@dataclass(frozen=True)
class Recipe:
    """The settings of one JEM recipe, as a tree. Print it to see them; :meth:`replace` changes them
    by their flat names (those of ``jem train``'s flags), ``dataclasses.replace`` by section."""

    name: str
    summary: str
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sam: SAMConfig = field(default_factory=SAMConfig)
    bn_stats_from_data: bool = field(
        default=False,
        metadata=_meta(
            "after training, recompute BatchNorm running statistics from the training data, kept only if held-out "
            "accuracy is not lower (the joint pass mixes the samples into them)"
        ),
    )

    # ------------------------------------------------------------------ reading and changing
    def __str__(self) -> str:
        rows = [f"recipe {self.name!r}: {self.summary}"]
        rows += [f"  {name:<22} {value!r}" for name, value in self.flat().items()]
        return "\n".join(rows)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name (``sgld_steps``, ``init_covariance``, ``lr``, ...): what
        ``jem train``'s flags and ``--config`` keys set. A choice (``init``) reads as its kind."""
        return _TREE.flat(self)

    def replace(self, **changes: Any) -> Recipe:
        """A copy with settings changed by flat name, e.g. ``replace(sgld_steps=10, init="gaussian",
        init_covariance="lowrank", init_rank=8)``. A kind (``init``, ``init_covariance``) is set
        before the settings inside it; a setting the current kind lacks is refused."""
        return _TREE.replace(self, changes, f"recipe {self.name!r}")

    def to_dict(self) -> dict[str, Any]:
        """The recipe as plain data (JSON, ``weights_only`` checkpoints); :meth:`from_dict` reads it back."""
        return _TREE.to_plain(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Recipe:
        """The recipe :meth:`to_dict` wrote."""
        try:
            return _TREE.from_plain(cls, data)
        except (TypeError, KeyError) as exc:
            raise InvalidInputError(f"not a recipe written by Recipe.to_dict: {exc}") from None

    def for_inputs(self, sample_shape: Sequence[int]) -> tuple[Recipe, list[str]]:
        """This recipe for inputs of ``sample_shape``, and what had to change (one line each).

        The image-only pieces (the stationary covariance, coarse chain starts, steps in the data's
        colours) need ``[C, H, W]`` inputs; for others they fall back to a diagonal covariance, no
        coarse starts and free steps.
        """
        if len(tuple(sample_shape)) == 3:
            return self, []
        changes: dict[str, Any] = {}
        init = self.buffer.init
        if isinstance(init, Gaussian) and isinstance(init.covariance, Stationary):
            changes["init_covariance"] = "diagonal"
        if isinstance(init, Gaussian) and init.coarse:
            changes["init_coarse"] = 0.0
        if self.sampler.colours != "all":
            changes["sgld_colours"] = "all"
        flat = self.flat()
        notes = [
            f"recipe {self.name!r}: inputs of shape {tuple(sample_shape)} are not images [C, H, W]: "
            f"{k} {flat[k]!r} -> {v!r}"
            for k, v in changes.items()
        ]
        return self.replace(**changes), notes

    # ------------------------------------------------------------------ building
    def build(
        self,
        jm: nn.Module,
        data: Tensor | tuple[Tensor, Tensor] | Dataset | Iterable,
        *,
        total_iters: int | None = None,
        batch_size: int | None = None,
        generator: torch.Generator | None = None,
        fit_examples: int = 5000,
    ) -> JEMSetup:
        """The sampler, buffer, loss, optimiser and extensions of this recipe for ``jm``.

        ``data``: training examples ``x`` (``[N, ...]``), ``(x, y)``, a dataset, or a loader (any
        iterable) of ``(x, y)`` batches. The input shape is read from it, and an informative init distribution
        (``gaussian``) is fitted on its first ``fit_examples`` examples, here, once. ``total_iters``
        (and ``batch_size`` when ``n_samples`` is unset): the run's length, which sizes a buffer
        with ``visits`` and caps the warm-up; without it such a buffer keeps ``capacity`` (with a
        warning). ``generator`` seeds the chains and the data noise. Nothing is built later behind
        the loss's back: the objects returned are all there is.
        """
        from ..model import as_jem

        core = as_jem(jm, "Recipe.build")
        x, y = _examples(data, fit_examples)
        sample_shape = tuple(int(s) for s in x.shape[1:])
        recipe, notes = self.for_inputs(sample_shape)
        device = next((p.device for p in core.parameters()), torch.device("cpu"))
        num_classes = core.num_classes
        if recipe._conditional() and num_classes is None:
            if y is None:
                raise InvalidInputError(
                    f"recipe {self.name!r} draws chains per class: give build() labelled data (x, y) "
                    "or wrap the model with num_classes="
                )
            num_classes = int(y.max()) + 1
        if not isinstance(recipe.buffer.init, Uniform) and y is None:
            raise InvalidInputError(f"recipe {self.name!r} fits a per-class init: give build() labelled data (x, y)")
        loss = recipe._loss_for(sample_shape, num_classes, x, y, device, generator, total_iters, batch_size)
        optimizer = recipe.optim.build(core.parameters())
        extensions: list[Extension] = []
        if recipe.sam.rho is not None:
            extensions.append(SharpnessAware(rho=recipe.sam.rho, adaptive=recipe.sam.adaptive))
        if recipe.bn_stats_from_data:
            extensions.append(RecomputeBatchNorm())
        return JEMSetup(
            recipe,
            cast(SGLD, loss.sampler),  # the SGLD the recipe built (a loss holds any Sampler)
            loss.buffer,
            loss,
            optimizer,
            extensions,
            recipe.optim.warmup_for(total_iters),
            notes,
        )

    def _conditional(self) -> bool:
        """Whether the buffer keeps one class per slot (a per-class init, p(x|y), class-conditional p(x))."""
        return not isinstance(self.buffer.init, Uniform) or self.loss.pxy_weight > 0 or self.loss.class_conditional_px

    def _loss_for(
        self,
        sample_shape: tuple[int, ...],
        num_classes: int | None,
        x: Tensor | None,
        y: Tensor | None,
        device: Any,
        generator: torch.Generator | None,
        total_iters: int | None,
        batch_size: int | None,
    ) -> JEMLoss:
        """The sampler, buffer (sized for the run, its init fitted on ``x``/``y``) and loss."""
        if self.buffer.visits is not None and not total_iters:
            warnings.warn(
                f"recipe {self.name!r} sizes its replay buffer for the run: pass total_iters=...; using "
                f"capacity {self.buffer.capacity} (in a short run, chains drawn only a few times stay near "
                "their init)",
                RuntimeWarning,
                stacklevel=3,  # the caller of Recipe.build
            )
        buffer = ReplayBuffer(
            self.buffer.capacity_for(total_iters, self.loss.n_samples or batch_size),
            sample_shape,
            reinit_freq=self.buffer.reinit_freq,
            init=self.buffer.init,
            num_classes=num_classes if self._conditional() else None,
            device=device,
        )
        if x is not None and not isinstance(self.buffer.init, Uniform):
            buffer.fit(x.to(device) if device else x, None if y is None else (y.to(device) if device else y))
        sampler = self.sampler.build(generator)  # steps in the data's colours read them from the buffer
        loss = self.loss.build(sampler, buffer, generator)
        return loss.to(device) if device is not None else loss


def _examples(data: Any, limit: int) -> tuple[Tensor, Tensor | None]:
    """Up to ``limit`` examples ``(x, y)`` from a tensor, a pair, a dataset or a loader."""
    if isinstance(data, Tensor):
        return data[:limit], None
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], Tensor):
        return data[0][:limit], torch.as_tensor(data[1])[:limit]
    if isinstance(data, DataLoader):
        data = data.dataset
    if isinstance(data, Dataset):
        n = min(len(data), limit)  # type: ignore[arg-type]  # map-style datasets have a length
        batch = next(iter(DataLoader(data, batch_size=n, shuffle=False)))
        if isinstance(batch, (tuple, list)) and len(batch) >= 2:
            return batch[0], torch.as_tensor(batch[1])
        return batch, None
    if isinstance(data, Iterable):  # batches of (x, y): the first ones, up to the limit
        xs, ys, n = [], [], 0
        for batch in data:
            x, y = unpack_batch(batch, need_labels=False)
            xs.append(x)
            ys.append(None if y is None else torch.as_tensor(y))
            n += len(x)
            if n >= limit:
                break
        if xs:
            labels = None if any(y is None for y in ys) else torch.cat([y for y in ys if y is not None])[:limit]
            return torch.cat(xs)[:limit], labels
    raise InvalidInputError(
        f"Recipe.build needs training examples: a tensor x, a pair (x, y), a dataset or a loader; got {type(data).__name__}"
    )


# ---------------------------------------------------------------------------- the tree's flat names
# A section's settings are prefixed with its section's name (sampler -> sgld), except the loss's and
# the optimiser's, read bare (lr, px_weight); a field's "flag" metadata names it outright; the
# settings inside a choice (init, init_covariance) take the choice's prefix (init_rank).
_TREE = ConfigTree(
    Recipe,
    prefixes={"sampler": "sgld", "buffer": "buffer", "sam": "sam", "loss": "", "optim": ""},
    unions={(BufferConfig, "init"): INIT_SPECS, (Gaussian, "covariance"): COVARIANCE_KINDS},
    tagged=(Poly,),
    skip=("name", "summary"),
)


def flat_names() -> dict[str, dict[str, Any]]:
    """Every recipe setting by flat name: ``{name: {"help", "path", "type", "choices", "optional"}}``,
    read from the tree's fields (``jem train`` derives its flags from this)."""
    return _TREE.describe()
