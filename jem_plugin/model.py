"""The energy view of a classifier: :func:`wrap` and :class:`JEM`.

Logits ``f(x)`` are reread as energies (Grathwohl et al. 2019): ``E(x, y) = -f(x)[y]``,
``E(x) = -logsumexp_y f(x)[y]``; ``p(y|x)`` is the softmax, unchanged.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from ._checks import check_input, check_labels, free_energy, unwrap_model
from .adapter import Adapter, InputDomain, Preprocess, check_wrap_options, no_layers_error
from .errors import (
    InferenceModeError,
    InvalidInputError,
    NoFeaturesError,
    NoLogitsError,
    NonFiniteLogitsError,
    NotWrappedError,
)
from .plugins import get_plugin_manager

__all__ = [
    "JEM",
    "wrap",
    "as_jem",
    "input_grad_enabled",
    "sampling_mode",
    "frozen_bn_stats",
    "running_bn_stats",
    "BatchNormMode",
    "BATCHNORM_MODES",
    "check_batchnorm",
]


class _CallableModule(nn.Module):
    """Holds a plain callable so it can be wrapped like any ``nn.Module``."""

    def __init__(self, fn: Callable[[Tensor], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Any:
        return self.fn(x)


class JEM(nn.Module):
    """A classifier read as a Joint Energy-based Model. Build it with :func:`wrap`.

    ``jm(x)`` returns the model's logits (the model's output itself when that is a tensor).
    ``jm.model`` is the user's module: same parameters, never copied. ``state_dict()`` uses
    the usual ``model.`` prefix; :meth:`load_state_dict` also accepts the user's own
    checkpoints of the bare model.
    """

    #: Whether the model's ``log p(x)`` was trained as a JEM: ``True`` once a ``JEMLoss`` with a
    #: p(x) or p(x|y) term has run a training step on it; ``None`` (the class default) when
    #: unknown. The scores that read ``log p(x)`` as a trained density (``grad_norm``,
    #: ``logpx_sgld``, ...) warn once when it is not ``True``; set it for a model trained as a JEM
    #: elsewhere. Not part of ``state_dict()``.
    trained_px: bool | None = None
    #: The class names of a model read by :func:`jem_plugin.load` (``None`` otherwise).
    classes: list[str] | None = None
    #: The temperature ``jem train`` kept for calibrated probabilities, ``softmax(jm(x) / T)``,
    #: as :func:`jem_plugin.load` reads it; ``None`` when none was kept (or not a loaded model).
    temperature: float | None = None

    def __init__(self, model: nn.Module, adapter: Adapter, check_finite: bool = True) -> None:
        super().__init__()
        self.model = model
        self.adapter = adapter
        self.check_finite = check_finite
        # Settled at wrap time from the adapter; what it cannot say (a plain callable's class
        # count, a generic model's input shape) the first forward settles, once, here on the
        # JEM: the adapter is never mutated.
        self._num_classes: int | None = adapter.num_classes
        self._domain: InputDomain = adapter.domain
        # The shape of the first batch a training step ran on (forward in train mode), what
        # SGLD.sample draws at; and whether a domain size that disagrees with it was named.
        self._trained_input_size: tuple[int, ...] | None = None
        self._size_conflict_told = False

    # ------------------------------------------------------------------ properties
    @property
    def domain(self) -> InputDomain:
        """The :class:`~jem_plugin.adapter.InputDomain` of the model's inputs."""
        return self._domain

    @property
    def num_classes(self) -> int | None:
        """Number of classes (logits); ``None`` only until the first forward when not inferable."""
        return self._num_classes

    @property
    def trained_input_size(self) -> tuple[int, ...] | None:
        """The input shape without the batch dimension (``(C, H, W)`` for images) of the first batch
        the model ran on in train mode: a training step (``JEMLoss``, ``fit``, ``jm(x)`` in your own
        loop); ``None`` before one. :meth:`~jem_plugin.SGLD.sample` draws at this size when given
        no ``shape``, and warns once when :attr:`domain`'s ``input_size`` (e.g. the size a timm
        model's pretrained config names) says otherwise. Not part of ``state_dict()``; a model file
        of ``jem train`` keeps the size it trained at as its domain's."""
        return self._trained_input_size

    def sample_shape(self) -> tuple[int, ...] | None:
        """The input shape to draw samples at when none is given: :attr:`trained_input_size`, else
        :attr:`domain`'s ``input_size``, else ``None``. Where both are known and differ, the trained
        size wins and a warning names both (once per model)."""
        trained, declared = self._trained_input_size, self._domain.input_size
        if trained is None:
            return tuple(declared) if declared is not None else None
        if declared is not None and tuple(declared) != trained and not self._size_conflict_told:
            self._size_conflict_told = True
            warnings.warn(
                f"sampling at {trained}, the input size this model was trained on; its domain says "
                f"{tuple(declared)} (from the adapter: a pretrained config, wrap(input_size=...)). Pass "
                "shape=... to sample at another size",
                UserWarning,
                stacklevel=3,
            )
        return trained

    def preprocessing(self, size: Sequence[int] | None = None) -> Preprocess:
        """Raw images to this model's input, as its training read them: a callable
        (:class:`~jem_plugin.adapter.Preprocess`) taking image file paths, PIL images or ``uint8``
        arrays ``(H, W[, C])``, one or a list, and returning ``[C, H, W]`` or ``[B, C, H, W]``:
        resized to the size the model trained on (:attr:`trained_input_size`, else :attr:`domain`'s
        ``input_size``; ``size=(C, H, W)`` for another), in its channels, scaled and normalised into
        :attr:`domain`. A model from :func:`jem_plugin.load` knows both from its file.

        >>> x = jm.preprocessing()(["cat.png", "dog.png"])  # [2, C, H, W]
        >>> probs = jm(x).softmax(1)
        """
        shape = tuple(size) if size is not None else self._trained_input_size or self._domain.input_size
        if shape is None:
            raise InvalidInputError(
                "the model's input size is unknown (no training batch seen, no input_size in its domain): "
                "pass preprocessing(size=(C, H, W))"
            )
        return Preprocess(self._domain, shape)

    def settle(self, *, num_classes: int | None = None, sample_shape: tuple[int, ...] | None = None) -> None:
        """Record what only a forward could tell: the class count and the input shape.

        Values already known are kept (they came from the model or the user at wrap time).
        """
        if num_classes is not None and self._num_classes is None:
            self._num_classes = int(num_classes)
        if sample_shape is not None and self._domain.input_size is None:
            d = self._domain
            self._domain = InputDomain(d.low, d.high, d.mean, d.std, tuple(int(s) for s in sample_shape))

    def param_dtype(self) -> torch.dtype | None:
        """The floating dtype of the model's parameters (inputs are cast to it), or ``None``."""
        for p in self.model.parameters():
            if p.is_floating_point():
                return p.dtype
        return None

    def extra_repr(self) -> str:
        return f"adapter={self.adapter.name!r}, num_classes={self.num_classes}"

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor) -> Tensor:
        """Logits ``f(x)``, exactly what the model computes. The first call in train mode records
        the input's shape (:attr:`trained_input_size`)."""
        if self._trained_input_size is None and self.training and isinstance(x, Tensor):
            self._trained_input_size = tuple(int(s) for s in x.shape[1:])
        return self.adapter.logits(self.model(x))

    def logits(self, x: Tensor) -> Tensor:
        """Validated logits: checks the input and the output shape, and finiteness if enabled.

        Floating inputs are cast to the parameters' dtype; the logits come back in fp32 when the
        model computed them in half precision (autocast), so energies and scores are fp32.
        """
        x = self._check_input(x)
        return self._checked_logits(x, self.forward(x))

    def features(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(features [B, D], logits [B, K])`` in one forward: the model's penultimate features
        (the input of its classifier layer) next to its validated logits (as :meth:`logits`).

        The adapter reads them (:meth:`jem_plugin.adapter.Adapter.features`: timm's
        ``forward_head(pre_logits=True)``, the input of the last ``nn.Linear`` for torchvision
        and user modules, the classifier's input for Hugging Face); ``wrap(model, features=...)``
        points elsewhere. Like :meth:`forward`, the model runs in the mode it is in (train mode
        gives the training-time features: dropout, batch statistics); both come back in fp32
        when the model computed them in half precision.
        """
        x = self._check_input(x)
        feats, out = self.adapter.features(self.model, x)
        logits = self._checked_logits(x, out)
        return self._checked_features(x, feats), logits

    def _checked_features(self, x: Tensor, feats: Tensor) -> Tensor:
        """The adapter's features of ``x`` checked to be ``[B, D]``, in fp32 where they were half."""
        if feats.dim() != 2 or feats.shape[0] != x.shape[0]:
            raise NoFeaturesError(
                f"expected features of shape [B={x.shape[0]}, D], the adapter returned shape "
                f"{tuple(feats.shape)}; point wrap(model, features=...) at the classifier layer"
            )
        return feats.float() if feats.dtype in (torch.float16, torch.bfloat16) else feats

    def feature_maps(self, x: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]] | None:
        """``(maps [B, C, H, W], to_logits)`` in one forward: the model's last feature maps before
        its classifier pools them, and the function mapping maps of that shape to the logits; or
        ``None`` where the adapter knows none (models whose head it cannot rebuild). The
        activation-shaping detectors (``ash``, ``scale``) shape these, as their papers do, and
        :meth:`features` where there are none. The adapter reads them
        (:meth:`jem_plugin.adapter.Adapter.feature_maps`: timm's ``forward_features`` and
        ``forward_head``, a timm ViT's pre-logits features as ``1 x 1`` maps; the input of an
        ``avgpool`` layer followed by ``fc``/``classifier``)."""
        x = self._check_input(x)
        return self._checked_maps(x, self.adapter.feature_maps(self.model, x))

    def _checked_maps(
        self, x: Tensor, found: tuple[Tensor, Callable[[Tensor], Tensor]] | None
    ) -> tuple[Tensor, Callable[[Tensor], Tensor]] | None:
        """The adapter's feature maps of ``x`` (or ``None``) checked to be ``[B, C, H, W]``."""
        if found is None:
            return None
        maps, to_logits = found
        if maps.dim() != 4 or maps.shape[0] != x.shape[0]:
            raise NoFeaturesError(
                f"expected feature maps of shape [B={x.shape[0]}, C, H, W], the adapter returned shape "
                f"{tuple(maps.shape)}"
            )
        return maps, to_logits

    def feature_layers(self) -> list[str] | None:
        """Dotted names of the layers whose outputs :meth:`layer_features` reads by default,
        shallow to deep, or ``None`` where the adapter knows none
        (:meth:`jem_plugin.adapter.Adapter.feature_layers`: a timm model's ``feature_info``
        stages, a ResNet's ``layer1``... ``layerN``, else the end of each resolution along the
        model's chain of blocks, or a transformer encoder's blocks)."""
        return self.adapter.feature_layers(self.model)

    def layer_features(self, x: Tensor, layers: Sequence[str] | None = None) -> tuple[list[Tensor], Tensor]:
        """``([B, C_i] per layer, logits [B, K])`` in one forward: the outputs of several layers,
        averaged over their spatial positions or tokens, next to the validated logits (as
        :meth:`logits`). ``layers``: dotted submodule names, shallow to deep (default:
        :meth:`feature_layers`). Multi-layer detectors (``multi_mahalanobis``) read these."""
        x = self._check_input(x)
        feats, out = self.adapter.layer_features(self.model, x, self._layer_names(layers))
        return [f.flatten(1) if f.dim() != 2 else f for f in feats], self._checked_logits(x, out)

    def layer_maps(self, x: Tensor, layers: Sequence[str] | None = None) -> tuple[list[Tensor], Tensor]:
        """``([B, C_i, P_i] per layer, logits [B, K])`` in one forward: the outputs of several
        layers, channels first with their ``P_i`` spatial positions or tokens flattened (what
        :meth:`layer_features` averages over), next to the validated logits. ``layers``: as in
        :meth:`layer_features`. The Gram-matrix detector (``gram``) reads these."""
        x = self._check_input(x)
        maps, out = self.adapter.layer_maps(self.model, x, self._layer_names(layers))
        return maps, self._checked_logits(x, out)

    def _layer_names(
        self, layers: Sequence[str] | None, name_them: str = "layers=['name.of.block1', 'name.of.block2', ...]"
    ) -> list[str]:
        """``layers``, else the adapter's default ones; where there are none, the error says to
        name them with ``name_them`` (the caller's own call)."""
        names = list(layers) if layers is not None else self.feature_layers()
        if not names:
            raise no_layers_error(self.model, name_them)
        return names

    def head(self) -> nn.Module | None:
        """The layer mapping :meth:`features` to the logits (``logits == head(features)``), or
        ``None`` when the adapter knows none (features read by a user's callable)."""
        return self.adapter.head(self.model)

    def _checked_logits(self, x: Tensor, out: Tensor) -> Tensor:
        if out.dim() != 2 or out.shape[0] != x.shape[0]:
            raise NoLogitsError(
                f"expected logits of shape [B={x.shape[0]}, K], the model returned shape "
                f"{tuple(out.shape)}. Point wrap(model, logits=...) at the classification "
                "output, or wrap a model whose head returns one score per class."
            )
        if out.dtype in (torch.float16, torch.bfloat16):
            out = out.float()
        if self._num_classes is None or self._domain.input_size is None:
            self.settle(num_classes=out.shape[1], sample_shape=tuple(x.shape[1:]))
        if self.check_finite and not torch.isfinite(out).all():
            raise NonFiniteLogitsError(
                f"the model produced {int((~torch.isfinite(out)).sum())} non-finite logits. "
                "Check the input for NaN/inf, lower the learning rate or SGLD step size, or "
                "add the energy L2 regulariser (JEMLoss(l2_weight=...)). "
                "Pass wrap(model, check_finite=False) to skip this check."
            )
        return out

    def energy(self, x: Tensor, y: Tensor | None = None) -> Tensor:
        """``E(x) = -logsumexp f(x)`` (``[B]``), or ``E(x, y) = -f(x)[y]`` when ``y`` is given."""
        logits = self.logits(x)
        if y is None:
            return free_energy(logits)
        return -logits.gather(1, self._check_labels(y, logits).unsqueeze(1)).squeeze(1)

    def log_px(self, x: Tensor) -> Tensor:
        """Unnormalised ``log p(x) = logsumexp_y f(x)[y]`` (``[B]``)."""
        return -self.energy(x)

    def log_pxy(self, x: Tensor, y: Tensor) -> Tensor:
        """Unnormalised ``log p(x, y) = f(x)[y]`` (``[B]``)."""
        return -self.energy(x, y)

    def log_py_given_x(self, x: Tensor, y: Tensor | None = None) -> Tensor:
        """``log p(y|x)``: ``[B, K]`` log-softmax, or ``[B]`` for given labels ``y``."""
        logp = torch.log_softmax(self.logits(x), dim=1)
        if y is None:
            return logp
        return logp.gather(1, self._check_labels(y, logp).unsqueeze(1)).squeeze(1)

    # ------------------------------------------------------------------ checks
    def _check_input(self, x: Any) -> Tensor:
        """The shared input check (:func:`jem_plugin._checks.check_input`); returns ``x`` cast to
        the parameters' dtype."""
        return check_input(x, dtype=self.param_dtype(), domain=self.domain)

    def _check_labels(self, y: Any, logits: Tensor) -> Tensor:
        return check_labels(y, logits.shape[0], num_classes=logits.shape[1], device=logits.device)

    # ------------------------------------------------------------------ state
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Load a JEM checkpoint, or a checkpoint of the bare model (keys without ``model.``)."""
        if state_dict and not any(k.startswith("model.") for k in state_dict):
            return self.model.load_state_dict(state_dict, strict=strict, assign=assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


@contextlib.contextmanager
def input_grad_enabled(x: Tensor) -> Iterator[Tensor]:
    """Yield a leaf copy of ``x`` that requires grad, even under ``no_grad``/``inference_mode``.

    Input gradients are what SGLD and gradient-based OOD scores need. Under
    ``torch.inference_mode`` (as in Lightning evaluation) we step out of inference mode
    locally; the parameters are ordinary tensors, so that is legal. Tensors *created* under
    inference mode are copied first, since autograd cannot record them.
    """
    try:
        with torch.inference_mode(False), torch.enable_grad():
            xg = x.detach().clone().requires_grad_(True)
            yield xg
    except RuntimeError as exc:
        if "inference" in str(exc).lower():
            raise InferenceModeError(
                "input gradients are impossible here because a tensor in the computation was "
                "created under torch.inference_mode (for example a buffer or a parameter built "
                "inside it). Create the model outside inference_mode, or call this under "
                "torch.no_grad() instead, which jem-plugin handles."
            ) from exc
        raise


def wrap(
    model: nn.Module | Callable[[Tensor], Any],
    *,
    adapter: str | Adapter | None = None,
    check_finite: bool = True,
    **options: Any,
) -> JEM:
    """Wrap a classifier as a :class:`JEM`. The model is not copied or modified.

    Parameters
    ----------
    model: an ``nn.Module`` (timm, torchvision, Hugging Face, your own) or a callable
        ``x -> logits``.
    adapter: force an adapter: an :class:`Adapter` instance, or the name of a registered one
        (``"timm"``, ``"torchvision"``, ``"huggingface"``, ``"generic"``). By default the
        ``jem_adapter`` plugin hook chooses (first answer wins, generic last).
    check_finite: raise :class:`NonFiniteLogitsError` on NaN/inf logits in the checked methods.
    **options: passed to adapters: ``logits`` (index, key, attribute or callable selecting the
        logits from the output), ``data_range=(low, high)``, ``mean``/``std`` (normalisation
        the inputs carry), ``input_size=(C, H, W)``, ``num_classes``, ``processor`` (a Hugging
        Face image processor: normalisation and size). Unknown options raise ``TypeError``;
        ``data_range`` with ``mean``/``std`` raises ``ValueError``.

    The adapter reads the model inside ``torch.compile``, DataParallel, DDP and FSDP wrappers
    (the wrapper itself is what runs). A JEM passed in is returned unchanged when no option is
    given.
    """
    check_wrap_options(options)
    if isinstance(model, JEM) and adapter is None and not options:
        return model
    if isinstance(unwrap_model(model), JEM):
        raise TypeError(
            f"wrap() got a {type(model).__name__} around a JEM: it is wrapped already. Pass it as it "
            "is (every jem-plugin function accepts a compiled or DDP-wrapped JEM), or wrap the bare "
            "model with the options you want before compiling it."
        )
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise TypeError(f"wrap() needs an nn.Module or a callable, got {type(model).__name__}")
        model = _CallableModule(model)
    if isinstance(adapter, Adapter):
        chosen = adapter
    elif adapter is None:
        chosen = get_plugin_manager().hook.jem_adapter(model=unwrap_model(model), options=dict(options))
        if chosen is None:
            raise NoLogitsError(
                f"no adapter accepted the model {type(model).__name__}; see `jem plugins` for the loaded adapters."
            )
    else:
        chosen = _forced_adapter(str(adapter), unwrap_model(model), dict(options))
    return JEM(model, chosen, check_finite=check_finite)


def _forced_adapter(name: str, model: nn.Module, options: dict) -> Adapter:
    """``wrap(..., adapter=name)``: ask every adapter plugin on its own (through pluggy) and keep
    the answer called ``name``. Adapters never see the forced name: this is the one place."""
    pm = get_plugin_manager()
    plugins = [impl.plugin for impl in pm.hook.jem_adapter.get_hookimpls()]
    offered = []
    for plugin in reversed(plugins):  # pluggy's calling order: latest registered first
        caller = pm.subset_hook_caller("jem_adapter", remove_plugins=[p for p in plugins if p is not plugin])
        found = caller(model=model, options=options)
        if found is not None and found.name == name:
            return found
        if found is not None:
            offered.append(found.name)
    raise NoLogitsError(
        f"no adapter accepted the model {type(model).__name__} with adapter={name!r}; adapters that do: "
        f"{', '.join(offered) or '(none)'}. Pass one of those, or an Adapter instance."
    )


def as_jem(obj: Any, what: str = "this") -> JEM:
    """The :class:`JEM` in ``obj``: a JEM, or a JEM inside ``torch.compile``/DataParallel/DDP/FSDP.

    Anything else raises :class:`~jem_plugin.errors.NotWrappedError` (a ``JEMError``) telling the user to wrap it: a raw
    classifier is never wrapped implicitly, since its input domain would be guessed unseen.
    """
    core = unwrap_model(obj)
    if isinstance(core, JEM):
        return core
    raise NotWrappedError(
        f"{what} needs the energy view of the classifier, got {type(core).__name__}. Wrap the "
        "model first: jm = jem_plugin.wrap(model) (check jm.domain), then pass jm."
    )


# ----------------------------------------------------------------------------- sampling mode
# Put a model into "sampling mode" for the length of an SGLD chain, then restore it exactly.
#
# SGLD needs gradients with respect to the *input* only. Two things go wrong if the model is left
# as the training loop had it:
#
# - BatchNorm in train mode normalises with batch statistics of the (bad) samples and updates its
#   running statistics with them; Dropout makes the energy landscape random.
# - Parameters that require grad make autograd record (and keep alive) a parameter-gradient graph
#   on every step, which costs time and memory, and backward hooks (DDP!) may fire.
#
# :func:`sampling_mode` switches every submodule to eval and every parameter to
# ``requires_grad=False``, and on exit restores each module's own ``training`` flag and each
# parameter's own ``requires_grad`` flag (a frozen backbone stays frozen, a module the user had put
# in eval stays in eval), also when the chain raises.


@contextlib.contextmanager
def _norm_flag_off(model: nn.Module | None, flag: str) -> Iterator[None]:
    """Every BatchNorm-like layer of ``model`` with ``flag`` on has it off inside the block, on after."""
    layers = [m for m in model.modules() if isinstance(m, _NormBase) and getattr(m, flag)] if model is not None else []
    for m in layers:
        setattr(m, flag, False)
    try:
        yield
    finally:
        for m in layers:
            setattr(m, flag, True)


def frozen_bn_stats(model: nn.Module | None) -> contextlib.AbstractContextManager[None]:
    """Inside, BatchNorm layers in train mode still normalise with batch statistics but do not
    update their running statistics or batch counters: the pass leaves no trace.

    Done by switching ``track_running_stats`` off for the block (nothing is modified in place,
    so a graph built before the block can still be backpropagated after it)."""
    return _norm_flag_off(model, "track_running_stats")


def running_bn_stats(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Inside, BatchNorm layers in train mode normalise by their running statistics, as at test
    time (so they do not update them either); everything else keeps its mode and parameters their
    gradients. For a term that must score inputs as test time will, inside a training step."""
    return _norm_flag_off(model, "training")


#: How samples meet BatchNorm layers, one spelling everywhere (``sampling_mode``, ``SGLD``,
#: ``PGDNegatives``, :class:`~jem_plugin.losses.JEMLoss`, the recipes): ``"joint"``, the samples are
#: normalised as the data are (the running statistics in the chains, the data's batch in the loss);
#: ``"separate"``, the samples are normalised by the statistics of their own batch.
BatchNormMode = Literal["joint", "separate"]
BATCHNORM_MODES: tuple[BatchNormMode, ...] = ("joint", "separate")


def check_batchnorm(mode: Any, what: str = "batchnorm", error: type[ValueError] = ValueError) -> BatchNormMode:
    """``mode`` if it is one of :data:`BATCHNORM_MODES`, else a one-line ``error``."""
    if mode not in BATCHNORM_MODES:
        raise error(f"{what} must be one of {BATCHNORM_MODES}, got {mode!r}")
    return cast(BatchNormMode, mode)


@contextlib.contextmanager
def sampling_mode(module: nn.Module, batchnorm: BatchNormMode = "joint") -> Iterator[nn.Module]:
    """Eval mode and frozen parameters inside the block; the exact previous flags after it.

    ``batchnorm``: ``"joint"`` normalises with the running statistics (chains independent of one
    another); ``"separate"`` makes every BatchNorm layer normalise with the statistics of the batch
    of chains itself, as JEM++ samples and as the samples' own pass of a loss whose sampler has
    ``batchnorm="separate"`` sees them, without updating the running statistics.

    Cheap: one pass over the modules and parameters on entry and one on exit (it runs once per
    chain, not once per step). The flags are set directly rather than through ``module.eval()``
    so that user overrides of ``train()`` (e.g. "keep BatchNorm frozen") cannot switch a layer
    back to training behaviour mid-chain.

    >>> with sampling_mode(model):
    ...     x = sgld_chain(model, x)
    """
    check_batchnorm(batchnorm)
    # One traversal; record only what we change, so restoring touches exactly those flags.
    # Flags are written with object.__setattr__: nn.Module.__setattr__ costs ~10x more and
    # `training` is a plain attribute. A parameter shared between modules is recorded once.
    was_training: list[nn.Module] = []
    had_grad: list[nn.Parameter] = []
    # "separate": every BatchNorm layer normalises with batch statistics (train mode) with tracking
    # off (no update), whatever mode the user left it in; restored to its own flags after.
    batch_norms: list[tuple[nn.Module, bool]] = []
    seen: set[int] = set()
    stack = [module]  # iterative walk over _modules: several times cheaper than modules()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if m.training:
            was_training.append(m)
        if batchnorm == "separate" and isinstance(m, _NormBase) and m.track_running_stats:
            batch_norms.append((m, m.training))
        for p in m._parameters.values():
            if p is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                had_grad.append(p)
        stack.extend(c for c in m._modules.values() if c is not None)
    try:
        for m in was_training:
            _set(m, "training", False)
        for p in had_grad:
            p.requires_grad_(False)
        for m, _ in batch_norms:
            _set(m, "training", True)
            _set(m, "track_running_stats", False)
        yield module
    finally:
        for m, training in batch_norms:
            _set(m, "track_running_stats", True)
            _set(m, "training", training)
        for m in was_training:
            _set(m, "training", True)
        for p in had_grad:
            p.requires_grad_(True)


_set = object.__setattr__
