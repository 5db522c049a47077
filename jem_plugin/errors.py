"""Exceptions raised by jem-plugin.

Every error a user can trigger with bad input derives from :class:`JEMError`, names the
problem and says how to fix it. They also derive from the builtin exception a user would
expect (``ValueError``, ``TypeError``, ``RuntimeError``) so existing ``except`` clauses work.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "JEMError",
    "NoLogitsError",
    "InvalidInputError",
    "InvalidLabelError",
    "NonFiniteLogitsError",
    "DivergenceError",
    "CheckpointError",
    "UnknownNameError",
    "InferenceModeError",
    "DatasetNotFoundError",
    "InvalidScoresError",
    "CUDAGraphError",
    "NotWrappedError",
    "OutOfDomainWarning",
    "NoFeaturesError",
    "NotFittedError",
    "MemoryLimitError",
    "UntrainedDensityWarning",
    "DeviceChangeWarning",
]


class JEMError(Exception):
    """Base class of every error jem-plugin raises on purpose."""


class NoLogitsError(JEMError, TypeError):
    """The wrapped model's output holds no usable ``[B, K]`` logits tensor."""


class NoFeaturesError(JEMError, TypeError):
    """The adapter cannot find the model's penultimate features (or the layer mapping them to the
    logits); ``wrap(model, features=...)`` says where they are."""


class NotFittedError(JEMError, ValueError):
    """A post-hoc OOD detector that needs training data was used before ``fit``, or
    :func:`jem_plugin.ood.score` was asked for one without ``fit_data=``."""


class MemoryLimitError(JEMError, MemoryError):
    """A post-hoc detector's fit would need more memory than its ``memory_limit``: refused before
    it allocates, in one line naming the setting that makes it fit."""


class InvalidInputError(JEMError, ValueError):
    """An input tensor has the wrong dtype, rank, shape or device."""


class NotWrappedError(JEMError, TypeError):
    """A JEM was expected (``jem_plugin.wrap(model)``, possibly compiled or DDP-wrapped), got a raw model."""


class InvalidLabelError(JEMError, ValueError):
    """Labels are not integer class indices in ``[0, num_classes)``."""


class NonFiniteLogitsError(JEMError, FloatingPointError):
    """The model produced NaN or infinite logits."""


class DivergenceError(JEMError, RuntimeError):
    """Energies became non-finite or exploded during JEM training or sampling.

    Fields (read them; never parse the message): ``reason``, what went wrong in one sentence;
    ``remedies``, what helps, one entry each; ``iteration``, the training iteration (``None``
    outside a training loop, e.g. a sampler's own check); ``energy``, the largest ``|energy|``
    seen (``nan``/``inf`` when non-finite; ``None`` when not measured); ``metrics``, the values
    shown with the reason (``loss``, ``energy_data``, ...). The message is built from them once.
    """

    def __init__(
        self,
        reason: str,
        *,
        remedies: Sequence[str] = (),
        iteration: int | None = None,
        energy: float | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        self.reason = str(reason)
        self.remedies: tuple[str, ...] = tuple(str(r) for r in remedies)
        self.iteration = iteration
        self.energy = energy
        self.metrics: dict[str, float] = dict(metrics or {})
        text = self.reason
        if iteration is not None:
            text = f"JEM training diverged at iteration {iteration}: {text}"
        if self.metrics:
            text += f" ({', '.join(f'{k}={v:.4g}' for k, v in self.metrics.items())})"
        if self.remedies:
            text += ". Known remedies: " + "; ".join(f"({i}) {r}" for i, r in enumerate(self.remedies, 1))
        super().__init__(text if text.endswith(".") else text + ".")


class CheckpointError(JEMError, RuntimeError):
    """A checkpoint is missing, corrupt, or does not match the object it is loaded into.

    ``reason`` says which (``"missing"``, ``"corrupt"``, ``"unsafe"``, ``"mismatch"``; ``None``
    when not classified), so callers can tell a damaged file from one that does not fit.
    """

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class UnknownNameError(JEMError, KeyError):
    """A named plugin item (OOD score, init distribution, loss term, ...) does not exist."""

    def __str__(self) -> str:  # KeyError would repr() the message and add quotes
        return str(self.args[0]) if self.args else ""

    @staticmethod
    def did_you_mean(name: str, choices: Iterable[str]) -> str:
        """``" (did you mean 'x'?)"``: the registered names nearest ``name`` (up to three, by
        difflib's similarity, the nearest first), or ``""`` when none is near. Every place that
        resolves a name says it the same way."""
        near = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.6)
        if not near:
            return ""
        words = [repr(n) for n in near]
        listed = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
        return f" (did you mean {listed}?)"


class InferenceModeError(JEMError, RuntimeError):
    """Input gradients were requested on a tensor created under ``torch.inference_mode``."""


class DatasetNotFoundError(JEMError, FileNotFoundError):
    """A local dataset (image folder, CIFAR-10 copy) is missing; jem-plugin never downloads data."""


class InvalidScoresError(JEMError, ValueError):
    """Scores, probabilities or labels handed to a metric are empty, misshapen or non-finite."""


class CUDAGraphError(JEMError, RuntimeError):
    """``SGLD(cuda_graph="require")`` could not run its chain as a captured CUDA graph."""


class OutOfDomainWarning(UserWarning):
    """Inputs lie outside the model's input domain (e.g. 0..255 pixels for a normalised model).

    Issued once per call site; silence it with
    ``warnings.filterwarnings("ignore", category=jem_plugin.OutOfDomainWarning)``.
    """


class UntrainedDensityWarning(UserWarning):
    """A score that reads the model's ``log p(x)`` as a trained density (``grad_norm``,
    ``grad_norm_projected``, ``logpx_sgld``, ``msp_sgld``) runs on a model whose ``log p(x)`` was
    not trained as a JEM (``jm.trained_px`` is not ``True``).

    Issued once per model. ``JEMLoss`` sets ``jm.trained_px = True`` when it trains a p(x) or
    p(x|y) term; set it yourself for a model trained as a JEM elsewhere, or silence the warning
    with ``warnings.filterwarnings("ignore", category=jem_plugin.errors.UntrainedDensityWarning)``.
    """


class DeviceChangeWarning(UserWarning):
    """A checkpoint's random generator ran on another kind of device than the one it is restored
    on (a run started on a GPU, resumed on the CPU): a CUDA generator's state cannot drive a CPU
    generator, so the generator is seeded from the saved state instead. The run continues,
    reproducibly, but not bit for bit as it would have on the saved device."""
