"""The persistent replay buffer of SGLD chains (Du & Mordatch 2019; JEM; JEM++).

Each training step starts its chains from stored samples (restarting a fraction ``reinit_freq``
of them from an initial distribution) and writes the finished chains back, so short chains add up
to long ones across steps. The buffer is part of the model's state: its samples, labels and the
fitted initial distribution are ``nn.Module`` buffers, so ``.to(device)`` keeps them where the
model is (no host round trip per step) and ``state_dict()`` resumes a run exactly.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from . import plugins
from ._checks import check_labels, draw
from ._colours import colour_projection
from .adapter import InputDomain
from .errors import CheckpointError, InvalidInputError, InvalidLabelError, JEMError

__all__ = ["ReplayBuffer"]

INIT_HOOK = "jem_register_init_distributions"


class _CallableInit:
    """Adapts a user function ``fn(n, shape, domain, generator, device, y=None)`` to the init protocol."""

    def __init__(self, fn: Callable[..., Tensor]) -> None:
        self.fn = fn

    def sample(self, n, shape, domain, generator=None, device=None, y=None) -> Tensor:
        return self.fn(n, shape, domain, generator, device, y=y)

    def __repr__(self) -> str:
        return f"callable {getattr(self.fn, '__qualname__', repr(self.fn))}"


def _resolve_init(init: str | Callable | Any, kwargs: dict) -> tuple[Any, str]:
    if isinstance(init, str):
        factory = plugins.lookup(INIT_HOOK, init, "init distribution")["item"]
        return factory(**kwargs), init
    if isinstance(init, type):  # a class implementing the protocol: instantiate it
        return init(**kwargs), init.__name__
    if kwargs:
        raise TypeError("init_kwargs only apply when init is a registered name or a class")
    if hasattr(init, "sample"):
        return init, type(init).__name__
    if callable(init):
        return _CallableInit(init), getattr(init, "__name__", "callable")
    raise TypeError(
        f"init must be the name of a registered init distribution, an object with .sample(...), or a "
        f"callable (n, shape, domain, generator, device, y=None) -> Tensor; got {type(init).__name__}"
    )


class ReplayBuffer(nn.Module):
    """Persistent SGLD chains: ``capacity`` samples of ``sample_shape``, stored as fp32 buffers.

    Parameters
    ----------
    capacity: number of stored samples (JEM: 10000).
    sample_shape: shape of one input, e.g. ``(3, 32, 32)``.
    reinit_freq: probability that a drawn slot restarts from the init distribution (JEM: 0.05).
        It bounds the chains' age, not the buffer's: they are about ``1 / reinit_freq`` draws old
        on average however long the run, and young chains hold the buffer near its init on
        networks whose chains move slowly (resnet18 at 32x32, issue 16 e87; the ``generative``
        recipe uses 0).
    init: name of a registered init distribution (``"uniform"``, ``"gaussian"``, ``"normal"``, or a
        plugin's), an object with ``sample(n, shape, domain, generator, device, y=None)``, or such a
        callable.
    init_kwargs: keyword arguments for a named init distribution, e.g. ``{"covariance": "full"}``.
    num_classes: enables class-conditional sampling: the buffer is split into ``num_classes``
        contiguous segments (slot ``i`` belongs to class ``labels[i]``) and ``sample(..., y=...)``
        draws each chain from its class's segment.
    device: where to create the samples. :meth:`SGLD.sample <jem_plugin.sampling.SGLD.sample>` and
        :class:`~jem_plugin.losses.JEMLoss` move the buffer to the model's device on first use
        (also after a checkpoint restored it on the CPU), so the chains never cross the bus.
    auto_fit_examples: when nobody fitted a fittable init (``"gaussian"``), ``JEMLoss`` fits it
        from the first batches (:meth:`fit_if_unfitted`): it keeps their examples, refits each time
        their count doubles and redraws the chains, until it holds this many. One batch of 64
        gives about six examples per class, too few for the ``generative`` preset's chains to move
        (issue 16, e63). ``0``: fit once, from the first batch. The examples stay on their device
        until then (1024 images of 3x224x224: 0.6 GB). Fitting on the training set with :meth:`fit`
        is still better; a checkpoint taken while it collects resumes with the fit so far.

    The samples are drawn lazily from the init distribution on the first :meth:`sample`, which
    receives the model's :class:`~jem_plugin.adapter.InputDomain`.
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
        init: str | Callable | Any = "uniform",
        init_kwargs: dict | None = None,
        num_classes: int | None = None,
        device=None,
        auto_fit_examples: int = 1024,
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
        if isinstance(auto_fit_examples, bool) or not isinstance(auto_fit_examples, int) or auto_fit_examples < 0:
            raise ValueError(f"auto_fit_examples must be an int >= 0, got {auto_fit_examples!r}")
        self.capacity = capacity
        self.sample_shape = sample_shape
        self.auto_fit_examples = auto_fit_examples
        self.reinit_freq = float(reinit_freq)
        self.num_classes = num_classes
        self.init_kwargs = dict(init_kwargs or {})
        init_obj, self.init_name = _resolve_init(init, dict(init_kwargs or {}))
        self.init_dist = init_obj  # an nn.Module init registers as a submodule: its buffers are saved

        self.register_buffer("data", torch.zeros(capacity, *sample_shape, device=device))
        if num_classes is None:
            labels = torch.full((capacity,), -1, dtype=torch.long, device=device)
        else:
            # floor(i * K / capacity): contiguous segments whose sizes differ by at most one.
            labels = torch.arange(capacity, device=device) * num_classes // capacity
        self.register_buffer("labels", labels)
        self.register_buffer("initialized", torch.tensor(False, device=device))
        if len(sample_shape) >= 2:  # images [C, ...]: the colour axes of the fitted data (identity until a fit)
            self.register_buffer("_colours", torch.eye(sample_shape[0], device=device))
            self._colours_fitted = False
        if num_classes is not None:
            size = torch.bincount(labels, minlength=num_classes)
            self.register_buffer("_seg_size", size, persistent=False)
            self.register_buffer("_seg_start", torch.cumsum(size, 0) - size, persistent=False)
        if isinstance(init_obj, nn.Module):
            init_obj.to(self.data.device)
        self._is_init = False  # host mirror of `initialized`: no device sync per sample()
        self._domain: InputDomain | None = None  # last domain seen, for save_grid
        # The first batches' examples while fit_if_unfitted is still fitting the init from them.
        self._auto_fit: list[tuple[Tensor, Tensor]] | None = None
        self._auto_fit_next = 0  # refit when this many examples are held

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
        self._domain = domain

    def reset(self) -> None:
        """Forget the stored chains; the next :meth:`sample` draws them afresh from the init distribution."""
        self._writable()
        with torch.inference_mode(False):
            self.initialized.fill_(False)
        self._is_init = False

    def _check_y(self, y: Any, n: int | None) -> Tensor:
        if self.num_classes is None:
            raise InvalidLabelError(
                "class-conditional sampling (y=...) needs a class-conditional buffer: create "
                "ReplayBuffer(..., num_classes=K)"
            )
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
    ) -> tuple[Tensor, Tensor]:
        """Draw ``n`` chain starts: ``(x [n, *shape] fp32, idx [n])``; pass ``idx`` to :meth:`update`.

        Slots are drawn uniformly (within the class segments of ``y`` when given); each restarts
        from the init distribution with probability ``reinit_freq``.
        """
        if y is not None:
            y = self._check_y(y, n)
            n = y.shape[0]
        if n is None or isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int (the number of chains), got {n!r}")
        with torch.inference_mode(False):
            if not self._is_init:
                self.initialize(domain, generator)
            self._domain = domain
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
    def fit(self, x: Tensor, y: Tensor | None = None) -> ReplayBuffer:
        """Fit the init distribution from data (the per-class ``"gaussian"`` init needs this).

        Already stored chains are kept; call :meth:`reset` to redraw them from the fitted distribution.
        This fit replaces the one ``JEMLoss`` makes from the first batches, which then stops.
        """
        self._auto_fit = None
        return self._fit(x, y)

    def _fit(self, x: Tensor, y: Tensor | None, **options: Any) -> ReplayBuffer:
        fit = getattr(self.init_dist, "fit", None)
        if fit is None:
            raise JEMError(f"the init distribution {self.init_name!r} has nothing to fit (it has no fit())")
        if tuple(x.shape[1:]) != self.sample_shape:
            raise InvalidInputError(
                f"fit(x, y) needs x of shape [N, {', '.join(map(str, self.sample_shape))}] (this "
                f"buffer's sample_shape), got {tuple(x.shape)}"
            )
        kwargs = {}
        if self.num_classes is not None and "num_classes" in inspect.signature(fit).parameters:
            kwargs["num_classes"] = self.num_classes
        fit(x, y, **kwargs, **options)
        if isinstance(self.init_dist, nn.Module):
            self.init_dist.to(self.data.device)
        if hasattr(self, "_colours"):
            self._colours = colour_projection(x).to(self.data.device)
            self._colours_fitted = True
        return self

    @property
    def colour_projection(self) -> Tensor | None:
        """``[C, C]`` projection onto the colour axes the data fitted by :meth:`fit` (or by
        ``JEMLoss`` from the first batches) vary along: one axis for grey images in an RGB model,
        the identity for colour images; ``None`` before a fit or for samples that are not
        ``[C, ...]``. ``SGLD(colours="data")`` confines its steps to it."""
        if not hasattr(self, "_colours"):
            return None
        fitted = self._colours_fitted or bool(getattr(self.init_dist, "fitted", False))
        return self._colours if fitted else None

    def fit_if_unfitted(self, x: Tensor, y: Tensor | None) -> bool:
        """Fit a fittable init distribution that nobody fitted, from the first batches.

        ``JEMLoss`` calls this on every training batch. The first call on an unfitted init (before
        any chain was drawn) fits it from that batch; later calls add their batch to the examples
        kept and refit, redrawing the chains, each time the count doubles, until
        ``auto_fit_examples`` are held. Classes missing from the examples get their pooled Gaussian.
        Returns whether it fitted.
        """
        if y is None:
            return False
        if self._auto_fit is None:
            if self._is_init or getattr(self.init_dist, "fitted", True):
                return False
            self._auto_fit, self._auto_fit_next = [], 0
        self._auto_fit.append(
            (x.detach().clone(), y.detach().reshape(-1).long().clone())
        )  # a loop may reuse its batch tensor
        held = sum(int(b.shape[0]) for b, _ in self._auto_fit)
        if held < self._auto_fit_next:
            return False
        x = torch.cat([b for b, _ in self._auto_fit])
        y = torch.cat([c for _, c in self._auto_fit])
        if "pool_missing" in inspect.signature(self.init_dist.fit).parameters:
            self._fit(x, y, pool_missing=True)
        else:  # a plugin's init: one copy of the examples per missing class, labelled with it
            k = self.num_classes if self.num_classes is not None else int(y.max()) + 1
            missing = [c for c in range(k) if not bool((y == c).any())]
            x = torch.cat([x] + [x] * len(missing))
            y = torch.cat([y] + [torch.full_like(y, c) for c in missing])
            self._fit(x, y)
        self.reset()  # the chains have barely moved yet: restart them from the better fit
        if held >= self.auto_fit_examples:
            self._auto_fit = None  # done: the init now counts as fitted
        else:
            self._auto_fit_next = 2 * held
        return True

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

    def save_grid(self, path: str | os.PathLike, n: int = 64, nrow: int = 8, domain: InputDomain | None = None) -> str:
        """Save ``n`` stored samples as a PNG grid (mapped to pixels through the domain); returns the
        path. Drawn by :func:`jem_plugin.viz.save_samples` (torchvision is imported only then)."""
        if len(self.sample_shape) != 3 or self.sample_shape[0] not in (1, 3):
            raise InvalidInputError(
                f"save_grid needs image samples of shape (1 or 3, H, W), this buffer holds {self.sample_shape}"
            )
        from .viz import save_samples

        return save_samples(self.samples(n), path, domain=domain or self._domain, nrow=nrow)

    # ------------------------------------------------------------------ state
    def config(self) -> dict[str, Any]:
        """The constructor arguments that rebuild this buffer, ``device`` aside (where it lives is
        not configuration): ``ReplayBuffer(**buffer.config())``. ``init`` is the init
        distribution's name; rebuilding from it needs a registered name."""
        return {
            "capacity": self.capacity,
            "sample_shape": tuple(self.sample_shape),
            "reinit_freq": self.reinit_freq,
            "init": self.init_name,
            "init_kwargs": dict(self.init_kwargs),
            "num_classes": self.num_classes,
            "auto_fit_examples": self.auto_fit_examples,
        }

    def get_extra_state(self) -> dict:
        state: dict[str, Any] = {"init": self.init_name, "config": self.config()}
        if not isinstance(self.init_dist, nn.Module) and hasattr(self.init_dist, "state_dict"):
            state["init_state"] = self.init_dist.state_dict()
        return state

    def set_extra_state(self, state: dict) -> None:
        # The settings that change no tensor's shape come back with the state; the structure
        # (capacity, shape, classes, init) was checked against this buffer in _load_from_state_dict.
        config = state.get("config", {})
        self.reinit_freq = float(config.get("reinit_freq", self.reinit_freq))
        self.auto_fit_examples = int(config.get("auto_fit_examples", self.auto_fit_examples))
        if "init_state" in state and hasattr(self.init_dist, "load_state_dict"):
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
        if isinstance(extra, dict) and extra.get("init") not in (None, self.init_name):
            raise CheckpointError(
                f"replay buffer checkpoint was saved with init distribution {extra['init']!r}, this buffer "
                f"uses {self.init_name!r}; create it with init={extra['init']!r}"
            )
        saved_kwargs = extra.get("config", {}).get("init_kwargs") if isinstance(extra, dict) else None
        if saved_kwargs is not None and saved_kwargs != self.init_kwargs:
            raise CheckpointError(
                f"replay buffer checkpoint was saved with init_kwargs={saved_kwargs!r}, this buffer uses "
                f"init_kwargs={self.init_kwargs!r}; create it with init_kwargs={saved_kwargs!r}"
            )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if prefix + "_colours" in missing_keys:  # saved before buffers kept their colour axes
            missing_keys.remove(prefix + "_colours")
        self._is_init = bool(self.initialized)
        self._auto_fit = None  # a restored init counts as fitted
        if hasattr(self, "_colours"):  # (an init with a `fitted` flag says it itself, once loaded)
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
        return (
            f"capacity={self.capacity}, sample_shape={self.sample_shape}, reinit_freq={self.reinit_freq}, "
            f"init={self.init_name!r}, num_classes={self.num_classes}, "
            f"initialized={self._is_init}, device={self.data.device}"
        )
