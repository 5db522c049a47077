"""The persistent replay buffer of SGLD chains (Du & Mordatch 2019; JEM; JEM++).

Each training step starts its chains from stored samples (restarting a fraction ``reinit_freq``
of them from an initial distribution) and writes the finished chains back, so short chains add up
to long ones across steps. The buffer is part of the model's state: its samples, labels and the
fitted initial distribution are ``nn.Module`` buffers, so ``.to(device)`` keeps them where the
model is (no host round trip per step) and ``state_dict()`` resumes a run exactly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from . import plugins
from ._checks import check_labels, draw, model_device
from ._colours import colour_projection
from .adapter import InputDomain
from .errors import CheckpointError, InvalidInputError, InvalidLabelError, JEMError
from .inits import (
    INIT_SPECS,
    FittedFromData,
    Gaussian,
    InitDistribution,
    InitSpec,
    Normal,
    PoolsMissingClasses,
    Uniform,
    init_options,
    init_spec_from_dict,
    init_spec_to_dict,
)
from .model import as_jem

__all__ = ["ReplayBuffer", "ReadOnlyBuffer"]

INIT_HOOK = "jem_register_init_distributions"
_UNIFORM = Uniform()


class _CallableInit:
    """Adapts a user function ``fn(n, shape, domain, generator, device, y=None)`` to the init protocol."""

    def __init__(self, fn: Callable[..., Tensor]) -> None:
        self.fn = fn

    def sample(self, n, shape, domain, generator=None, device=None, y=None) -> Tensor:
        return self.fn(n, shape, domain, generator, device, y=y)

    def __repr__(self) -> str:
        return f"callable {getattr(self.fn, '__qualname__', repr(self.fn))}"


@runtime_checkable
class _Fittable(Protocol):
    """An init distribution with a ``fit(x, y, ...)``."""

    def fit(self, x: Tensor, y: Tensor, *args: Any, **kwargs: Any) -> Any: ...


def _takes(fn: Callable, name: str) -> bool:
    # Init distributions are plugins' objects (the core never imports the built-ins): a third
    # party's fit(x, y) may not take num_classes, so its signature says whether to pass it.
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _spelled(plain: Mapping[str, Any]) -> str:
    """How to write the init that ``plain`` describes, for an error message."""
    if plain.get("kind") in INIT_SPECS:
        try:
            return repr(init_spec_from_dict(dict(plain)))
        except (TypeError, ValueError, KeyError):
            pass
    return repr(plain["kind"]) if len(plain) == 1 else repr(dict(plain))


def _resolve_init(init: Any) -> tuple[Any, str, InitSpec | None, dict[str, Any] | None]:
    """``(distribution object, name, spec or None, plain data that rebuilds it or None)``."""
    if isinstance(init, Mapping):  # plain data, as config() writes it
        data = dict(init)
        if not isinstance(data.get("kind"), str):
            raise TypeError(f"init as plain data needs the registered name under 'kind', got {data!r}")
        if data["kind"] not in INIT_SPECS:
            name = data.pop("kind")
            factory = plugins.lookup(INIT_HOOK, name, "init distribution")["item"]
            return factory(**data), name, None, {"kind": name, **data}
        init = init_spec_from_dict(data)
    if isinstance(init, str):
        if init not in INIT_SPECS:  # a plugin's distribution, by its registered name
            factory = plugins.lookup(INIT_HOOK, init, "init distribution")["item"]
            return factory(), init, None, {"kind": init}
        init = INIT_SPECS[init]()  # a built-in spec's name: its defaults
    if isinstance(init, (Uniform, Gaussian, Normal)):
        name, options = init_options(init)
        factory = plugins.lookup(INIT_HOOK, name, "init distribution")["item"]
        return factory(**options), name, init, init_spec_to_dict(init)
    if isinstance(init, type):  # a class implementing the protocol: instantiate it
        return init(), init.__name__, None, None
    if isinstance(init, InitDistribution):
        return init, type(init).__name__, None, None
    if callable(init):
        return _CallableInit(init), getattr(init, "__name__", "callable"), None, None
    raise TypeError(
        "init must be an init spec (jem_plugin.inits.Uniform(), Gaussian(...), Normal(...)), the name of "
        "a registered init distribution, an object with .sample(...), or a callable "
        f"(n, shape, domain, generator, device, y=None) -> Tensor; got {type(init).__name__}"
    )


class ReadOnlyBuffer:
    """A replay buffer's chains to start from, left unchanged (what validation samples from):
    :meth:`sample` draws from the buffer with this view's generator, whatever generator the
    sampler passes, and :meth:`update` drops the finished chains. Made by
    :meth:`ReplayBuffer.read_only`; pass it as ``sampler.sample(jm, n, buffer=view)``."""

    def __init__(self, buffer: ReplayBuffer, generator: torch.Generator | None = None) -> None:
        self.buffer, self.generator = buffer, generator

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The buffer's ``sample_shape``."""
        return self.buffer.sample_shape

    @property
    def colour_projection(self) -> Tensor | None:
        """The buffer's :attr:`ReplayBuffer.colour_projection`."""
        return self.buffer.colour_projection

    @property
    def num_classes(self) -> int | None:
        """The buffer's ``num_classes`` (a sampler bounds the labels it draws for by it)."""
        return self.buffer.num_classes

    def sample(
        self,
        n: int | None = None,
        *,
        domain: InputDomain,
        y: Tensor | None = None,
        generator: Any = None,
        validate: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """:meth:`ReplayBuffer.sample` with this view's generator (``generator`` is ignored)."""
        return self.buffer.sample(n, domain=domain, y=y, generator=self.generator, validate=validate)

    def update(self, idx: Tensor, x: Tensor) -> None:
        """Nothing: the buffer stays as it was."""

    def __repr__(self) -> str:
        return f"ReadOnlyBuffer({self.buffer!r})"


class ReplayBuffer(nn.Module):
    """Persistent SGLD chains: ``capacity`` samples of ``sample_shape``, stored as fp32 buffers.

    Parameters
    ----------
    capacity: number of stored samples (JEM: 10000).
    sample_shape: shape of one input, e.g. ``(3, 32, 32)``.
    reinit_freq: probability that a drawn slot restarts from the init distribution (JEM: 0.05).
        It bounds the chains' age, not the buffer's: they are about ``1 / reinit_freq`` draws old
        on average however long the run, and young chains hold the buffer near its init on
        networks whose chains move slowly (such as resnet18 at 32x32; the ``generative`` recipe
        uses 0).
    init: where chains start. An init spec from :mod:`jem_plugin.inits`: ``Uniform()`` (default,
        JEM), ``Gaussian(covariance=...)`` (a per-class Gaussian fitted from data, JEM++; see
        :mod:`jem_plugin.covariance`), ``Normal(mean, std)``; or the name of a registered init
        distribution (a plugin's, or ``"uniform"``/``"gaussian"``/``"normal"`` with their
        defaults), or plain data ``{"kind": name, **options}`` as :meth:`config` writes it; or an
        object with ``sample(n, shape, domain, generator, device, y=None)``, or such a callable.
    num_classes: enables class-conditional sampling: the buffer is split into ``num_classes``
        contiguous segments (slot ``i`` belongs to class ``labels[i]``) and ``sample(..., y=...)``
        draws each chain from its class's segment.
    device: where to create the samples. :meth:`SGLD.sample <jem_plugin.sampling.SGLD.sample>` and
        :class:`~jem_plugin.losses.JEMLoss` move the buffer to the model's device on first use
        (also after a checkpoint restored it on the CPU), so the chains never cross the bus.

    An informative init (``Gaussian``) is fitted from data with :meth:`fit` before the first
    draw, or from the first training batches with
    :class:`~jem_plugin.extensions.FitInitFromBatches`. The samples are drawn lazily from the init
    distribution on the first :meth:`sample`, which receives the model's
    :class:`~jem_plugin.adapter.InputDomain`. :meth:`for_model` builds one for a wrapped model.
    """

    # Registered buffers (nn.Module's __getattr__ would type them as Tensor | Module).
    data: Tensor
    labels: Tensor
    initialized: Tensor
    _colours: Tensor
    _seg_size: Tensor
    _seg_start: Tensor

    def __init__(
        self,
        capacity: int = 10000,
        sample_shape: Sequence[int] = (3, 32, 32),
        reinit_freq: float = 0.05,
        *,
        init: InitSpec | str | Mapping[str, Any] | Callable | Any = _UNIFORM,
        num_classes: int | None = None,
        device=None,
    ) -> None:
        super().__init__()
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if isinstance(sample_shape, int):
            sample_shape = (sample_shape,)
        sample_shape = tuple(int(s) for s in sample_shape)
        if not sample_shape or any(s < 1 for s in sample_shape):
            raise ValueError(f"sample_shape must be a non-empty tuple of positive sizes, got {sample_shape}")
        if not 0.0 <= float(reinit_freq) <= 1.0:
            raise ValueError(f"reinit_freq is a probability in [0, 1], got {reinit_freq}")
        if num_classes is not None:
            if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
                raise ValueError(f"num_classes must be a positive int or None, got {num_classes!r}")
            if capacity < num_classes:
                raise ValueError(
                    f"capacity {capacity} is smaller than num_classes {num_classes}: every class needs "
                    "at least one slot; use a capacity of at least num_classes (JEM uses 10000)"
                )
        self.capacity = capacity
        self.sample_shape = sample_shape
        self.reinit_freq = float(reinit_freq)
        self.num_classes = num_classes
        init_obj, self.init_name, self.init_spec, self._init_plain = _resolve_init(init)
        self.init_dist = init_obj  # an nn.Module init registers as a submodule: its buffers are saved

        self.register_buffer("data", torch.zeros(capacity, *sample_shape, device=device))
        if num_classes is None:
            labels = torch.full((capacity,), -1, dtype=torch.long, device=device)
        else:
            # floor(i * K / capacity): contiguous segments whose sizes differ by at most one.
            labels = torch.arange(capacity, device=device) * num_classes // capacity
        self.register_buffer("labels", labels)
        self.register_buffer("initialized", torch.tensor(False, device=device))
        self._has_colours = len(sample_shape) >= 2
        self._colours_fitted = False
        if self._has_colours:  # images [C, ...]: the colour axes of the fitted data (identity until a fit)
            self.register_buffer("_colours", torch.eye(sample_shape[0], device=device))
        if num_classes is not None:
            size = torch.bincount(labels, minlength=num_classes)
            self.register_buffer("_seg_size", size, persistent=False)
            self.register_buffer("_seg_start", torch.cumsum(size, 0) - size, persistent=False)
        if isinstance(init_obj, nn.Module):
            init_obj.to(self.data.device)
        self._is_init = False  # host mirror of `initialized`: no device sync per sample()
        #: How many times the init was fitted (:meth:`fit`) or restored from a checkpoint: a
        #: :class:`~jem_plugin.extensions.FitInitFromBatches` collecting batches stops when someone
        #: else fits it.
        self.fit_count = 0

    @classmethod
    def for_model(
        cls,
        jm: Any,
        sample_shape: Sequence[int] | None = None,
        *,
        capacity: int = 10000,
        reinit_freq: float = 0.05,
        init: InitSpec | str | Mapping[str, Any] | Callable | Any = _UNIFORM,
        class_conditional: bool = False,
    ) -> ReplayBuffer:
        """A buffer for ``jm`` (``jem_plugin.wrap(model)``), on its device: ``sample_shape``
        defaults to the domain's ``input_size``; ``class_conditional=True`` (what ``JEMLoss``
        needs with ``pxy_weight > 0`` or ``class_conditional_px=True``) gives it one segment per
        class of the model. The other arguments are the constructor's (paper defaults)."""
        core = as_jem(jm, "ReplayBuffer.for_model")
        shape = tuple(sample_shape) if sample_shape is not None else core.domain.input_size
        if shape is None:
            raise InvalidInputError(
                "ReplayBuffer.for_model: the model's input shape is unknown; pass sample_shape=(C, H, W)"
            )
        num_classes = None
        if class_conditional:
            num_classes = core.num_classes
            if num_classes is None:
                raise InvalidInputError(
                    "ReplayBuffer.for_model(class_conditional=True): the model's class count is unknown; "
                    "wrap it with jem_plugin.wrap(model, num_classes=K) or build ReplayBuffer(..., num_classes=K)"
                )
        return cls(capacity, shape, reinit_freq, init=init, num_classes=num_classes, device=model_device(core))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ReplayBuffer:
        """The buffer :meth:`config` describes."""
        return cls(**config)

    # ------------------------------------------------------------------ drawing
    @property
    def device(self) -> torch.device:
        """The device the stored samples live on."""
        return self.data.device

    def _init_draw(self, n: int, domain: InputDomain, generator, y: Tensor | None) -> Tensor:
        x = self.init_dist.sample(n, self.sample_shape, domain, generator, self.data.device, y=y)
        if not isinstance(x, Tensor) or tuple(x.shape) != (n, *self.sample_shape):
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise InvalidInputError(
                f"init distribution {self.init_name!r} returned {got}, expected a tensor of shape "
                f"{(n, *self.sample_shape)}"
            )
        return x.to(device=self.data.device, dtype=self.data.dtype)

    def _writable(self) -> None:
        # A buffer built inside torch.inference_mode holds inference tensors, which cannot be
        # updated in place outside it: swap in normal copies (once).
        if self.data.is_inference() or self.initialized.is_inference():
            with torch.inference_mode(False):
                self.data = self.data.clone()
                self.initialized = self.initialized.clone()

    @torch.no_grad()
    def initialize(self, domain: InputDomain, generator: torch.Generator | None = None) -> None:
        """Fill every slot from the init distribution (done lazily by the first :meth:`sample`)."""
        self._writable()
        with torch.inference_mode(False):
            y = self.labels if self.num_classes is not None else None
            self.data.copy_(self._init_draw(self.capacity, domain, generator, y))
            self.initialized.fill_(True)
        self._is_init = True

    def reset(self) -> None:
        """Forget the stored chains; the next :meth:`sample` draws them afresh from the init distribution."""
        self._writable()
        with torch.inference_mode(False):
            self.initialized.fill_(False)
        self._is_init = False

    def _check_y(self, y: Any, n: int | None, validate: bool) -> Tensor:
        if self.num_classes is None:
            raise InvalidLabelError(
                "class-conditional sampling (y=...) needs a class-conditional buffer: create "
                "ReplayBuffer(..., num_classes=K)"
            )
        if not validate:  # checked by the caller (a sampler's public edge): only placed here
            return y.to(self.data.device)
        return check_labels(
            y, n, num_classes=self.num_classes, device=self.data.device, what="y (one class segment per chain)"
        )

    @torch.no_grad()
    def sample(
        self,
        n: int | None = None,
        *,
        domain: InputDomain,
        y: Tensor | None = None,
        generator: torch.Generator | None = None,
        validate: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """Draw ``n`` chain starts: ``(x [n, *shape] fp32, idx [n])``; pass ``idx`` to :meth:`update`.

        Slots are drawn uniformly (within the class segments of ``y`` when given); each restarts
        from the init distribution with probability ``reinit_freq``. ``validate=False``: ``y`` was
        checked by the caller (long labels below ``num_classes``), as a sampler's ``sample`` does.
        """
        if y is not None:
            y = self._check_y(y, n, validate)
            n = y.shape[0]
        if n is None or isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int (the number of chains), got {n!r}")
        with torch.inference_mode(False):
            if not self._is_init:
                self.initialize(domain, generator)
            dev = self.data.device
            if y is None:
                idx = draw(lambda size, **kw: torch.randint(0, self.capacity, size, **kw), (n,), generator, dev)
            else:
                size = self._seg_size[y]
                offset = (draw(torch.rand, (n,), generator, dev) * size).long()
                idx = self._seg_start[y] + torch.minimum(offset, size - 1)
            x = self.data[idx]
            if self.reinit_freq > 0:
                # Draw only the restarted chains (one small host sync): a full batch of fresh
                # samples would cost more than the rest of the buffer's work together.
                rows = (draw(torch.rand, (n,), generator, dev) < self.reinit_freq).nonzero().squeeze(1)
                if rows.numel():
                    labels = y if y is not None else (self.labels[idx] if self.num_classes is not None else None)
                    x[rows] = self._init_draw(rows.numel(), domain, generator, None if labels is None else labels[rows])
        return x, idx

    @torch.no_grad()
    def update(self, idx: Tensor, x: Tensor) -> None:
        """Write finished chains ``x`` back into slots ``idx`` (as returned by :meth:`sample`)."""
        if tuple(x.shape[1:]) != self.sample_shape or x.shape[0] != idx.shape[0]:
            raise InvalidInputError(
                f"update(idx, x) needs x of shape [{idx.shape[0]}, {', '.join(map(str, self.sample_shape))}], "
                f"got {tuple(x.shape)}"
            )
        self._writable()
        with torch.inference_mode(False):
            self.data.index_copy_(0, idx.to(self.data.device), x.detach().to(self.data.device, self.data.dtype))

    # ------------------------------------------------------------------ init distribution
    @property
    def has_samples(self) -> bool:
        """Whether the chains were drawn (by the first :meth:`sample` or :meth:`initialize`)."""
        return self._is_init

    @property
    def needs_fit(self) -> bool:
        """Whether the init distribution is fitted from data and has not been yet (an unfitted
        ``Gaussian`` init): the first draw would fail until :meth:`fit`."""
        return isinstance(self.init_dist, FittedFromData) and not self.init_dist.fitted

    def fit(
        self, x: Tensor, y: Tensor | None = None, *, missing_classes: Literal["error", "pool"] = "error"
    ) -> ReplayBuffer:
        """Fit the init distribution from data (the per-class ``Gaussian`` init needs this).

        ``missing_classes``: what classes without examples in ``y`` get; ``"error"`` (the
        init's own rule: the Gaussian refuses them) or ``"pool"``: the distribution of all the
        examples (what :class:`~jem_plugin.extensions.FitInitFromBatches` asks for: a few
        batches need not hold every class). Already stored chains are kept; call :meth:`reset`
        to redraw them from the fitted distribution.
        """
        if missing_classes not in ("error", "pool"):
            raise ValueError(f"missing_classes must be 'error' or 'pool', got {missing_classes!r}")
        init = self.init_dist
        if not isinstance(init, _Fittable):
            raise JEMError(f"the init distribution {self.init_name!r} has nothing to fit (it has no fit())")
        if tuple(x.shape[1:]) != self.sample_shape:
            raise InvalidInputError(
                f"fit(x, y) needs x of shape [N, {', '.join(map(str, self.sample_shape))}] (this "
                f"buffer's sample_shape), got {tuple(x.shape)}"
            )
        options: dict[str, Any] = {}
        if self.num_classes is not None and _takes(init.fit, "num_classes"):
            options["num_classes"] = self.num_classes
        if missing_classes == "pool" and y is not None:
            if isinstance(init, PoolsMissingClasses) and init.pools_missing_classes:
                options["pool_missing"] = True
            else:  # one copy of the examples per missing class, labelled with it
                k = self.num_classes if self.num_classes is not None else int(y.max()) + 1
                missing = [c for c in range(k) if not bool((y == c).any())]
                x = torch.cat([x] + [x] * len(missing))
                y = torch.cat([y] + [torch.full_like(y, c) for c in missing])
        init.fit(x, y, **options)
        self.fit_count += 1
        if isinstance(init, nn.Module):
            init.to(self.data.device)
        if self._has_colours:
            self._colours = colour_projection(x).to(self.data.device)
            self._colours_fitted = True
        return self

    @property
    def colour_projection(self) -> Tensor | None:
        """``[C, C]`` projection onto the colour axes the data fitted by :meth:`fit` vary along:
        one axis for grey images in an RGB model, the identity for colour images; ``None`` before
        a fit or for samples that are not ``[C, ...]``. ``SGLD(colours="data")`` confines its
        steps to it."""
        if not self._has_colours:
            return None
        fitted = self._colours_fitted or (isinstance(self.init_dist, FittedFromData) and self.init_dist.fitted)
        return self._colours if fitted else None

    def read_only(self, generator: torch.Generator | None = None) -> ReadOnlyBuffer:
        """This buffer's chains to start from without changing it: a :class:`ReadOnlyBuffer` that
        draws with ``generator`` and drops writes (validation:
        ``sampler.sample(jm, n, buffer=buffer.read_only(g))``)."""
        return ReadOnlyBuffer(self, generator)

    # ------------------------------------------------------------------ looking at it
    def _require_init(self) -> None:
        if not self._is_init:
            raise JEMError(
                "the replay buffer holds no samples yet: it is filled on the first "
                "sampler.sample(jm, buffer=...) call, or call buffer.initialize(jm.domain)"
            )

    def samples(self, n: int | None = None, y: int | None = None) -> Tensor:
        """A copy of stored samples: ``n`` evenly spaced slots (all when ``None``), of class ``y`` if given."""
        self._require_init()
        lo, hi = 0, self.capacity
        if y is not None:
            if self.num_classes is None or not 0 <= int(y) < self.num_classes:
                raise InvalidLabelError(
                    f"samples(y={y}) needs a class-conditional buffer and 0 <= y < num_classes ({self.num_classes})"
                )
            lo = int(self._seg_start[int(y)])
            hi = lo + int(self._seg_size[int(y)])
        count = hi - lo
        if n is None or n >= count:
            return self.data[lo:hi].clone()
        idx = torch.linspace(lo, hi - 1, n, device=self.data.device).round().long()
        return self.data[idx].clone()

    # ------------------------------------------------------------------ state
    def config(self) -> dict[str, Any]:
        """The constructor arguments that rebuild this buffer, as plain data, ``device`` aside
        (where it lives is not configuration): ``ReplayBuffer(**buffer.config())``. ``init`` is
        the spec as :func:`~jem_plugin.inits.init_spec_to_dict` writes it (``{"kind": name,
        **options}`` for a plugin's registered distribution); an init given as an object or a
        callable is only named, and rebuilding from that name needs it registered."""
        return {
            "capacity": self.capacity,
            "sample_shape": tuple(self.sample_shape),
            "reinit_freq": self.reinit_freq,
            "init": dict(self._init_plain) if self._init_plain is not None else self.init_name,
            "num_classes": self.num_classes,
        }

    def _plain_init(self) -> dict[str, Any]:
        return dict(self._init_plain) if self._init_plain is not None else {"kind": self.init_name}

    def get_extra_state(self) -> dict:
        state: dict[str, Any] = {"init": self.init_name, "config": self.config()}
        if not isinstance(self.init_dist, nn.Module) and isinstance(self.init_dist, _Stateful):
            state["init_state"] = self.init_dist.state_dict()
        return state

    def set_extra_state(self, state: dict) -> None:
        # The settings that change no tensor's shape come back with the state; the structure
        # (capacity, shape, classes, init) was checked against this buffer in _load_from_state_dict.
        config = state.get("config", {})
        self.reinit_freq = float(config.get("reinit_freq", self.reinit_freq))
        if "init_state" in state and isinstance(self.init_dist, _Stateful):
            self.init_dist.load_state_dict(state["init_state"])

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        data = state_dict.get(prefix + "data")
        if data is not None and tuple(data.shape) != tuple(self.data.shape):
            raise CheckpointError(
                f"replay buffer checkpoint holds {data.shape[0]} samples of shape {tuple(data.shape[1:])}, "
                f"this buffer has capacity {self.capacity} and sample_shape {self.sample_shape}; create "
                f"the buffer with ReplayBuffer(capacity={data.shape[0]}, sample_shape={tuple(data.shape[1:])}) "
                "to resume from it, or start a new buffer"
            )
        labels = state_dict.get(prefix + "labels")
        if labels is not None and not torch.equal(labels.cpu(), self.labels.cpu()):
            raise CheckpointError(
                "replay buffer checkpoint has different class segments (num_classes) than this buffer "
                f"(num_classes={self.num_classes}); create it with the num_classes it was saved with"
            )
        extra = state_dict.get(prefix + "_extra_state")
        saved = _saved_init(extra) if isinstance(extra, dict) else None
        if saved is not None and saved != self._plain_init():
            raise CheckpointError(
                f"replay buffer checkpoint was saved with init={_spelled(saved)}, this buffer uses "
                f"init={_spelled(self._plain_init())}; create it with init={_spelled(saved)}"
            )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        self._is_init = bool(self.initialized)
        self.fit_count += 1  # a restored init counts as fitted
        if self._has_colours:  # (an init with a `fitted` flag says it itself, once loaded)
            self._colours_fitted = not torch.equal(
                self._colours, torch.eye(self._colours.shape[0], device=self._colours.device)
            )

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        except CheckpointError:
            raise
        except RuntimeError as exc:  # missing/unexpected keys: not a replay-buffer checkpoint of this kind
            raise CheckpointError(f"could not load the replay buffer checkpoint: {exc}") from exc

    def extra_repr(self) -> str:
        init = repr(self.init_spec) if self.init_spec is not None else repr(self.init_name)
        return (
            f"capacity={self.capacity}, sample_shape={self.sample_shape}, reinit_freq={self.reinit_freq}, "
            f"init={init}, num_classes={self.num_classes}, "
            f"initialized={self._is_init}, device={self.data.device}"
        )


@runtime_checkable
class _Stateful(Protocol):
    """A plain (non-Module) init distribution that carries state of its own."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _saved_init(extra: dict[str, Any]) -> dict[str, Any] | None:
    """The init a buffer's saved state was built with, as plain data (``None``: not recorded)."""
    config = extra.get("config")
    init = config.get("init") if isinstance(config, dict) else None
    if isinstance(init, Mapping):
        if init.get("kind") in INIT_SPECS:  # a spec's options added since it was saved read as their defaults
            try:
                return init_spec_to_dict(init_spec_from_dict(dict(init)))
            except (TypeError, ValueError, KeyError):
                pass
        return dict(init)
    return None if init is None else {"kind": init}
