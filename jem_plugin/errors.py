"""Exceptions raised by jem-plugin.

Every error a user can trigger with bad input derives from :class:`JEMError`, names the
problem and says how to fix it. They also derive from the builtin exception a user would
expect (``ValueError``, ``TypeError``, ``RuntimeError``) so existing ``except`` clauses work.
"""
from __future__ import annotations

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
    "NotWrappedError",
    "OutOfDomainWarning",
]


class JEMError(Exception):
    """Base class of every error jem-plugin raises on purpose."""


class NoLogitsError(JEMError, TypeError):
    """The wrapped model's output holds no usable ``[B, K]`` logits tensor."""


class InvalidInputError(JEMError, ValueError):
    """An input tensor has the wrong dtype, rank, shape or device."""


class NotWrappedError(JEMError, TypeError):
    """A JEM was expected (``jem_plugin.wrap(model)``, possibly compiled or DDP-wrapped), got a raw model."""


class InvalidLabelError(JEMError, ValueError):
    """Labels are not integer class indices in ``[0, num_classes)``."""


class NonFiniteLogitsError(JEMError, FloatingPointError):
    """The model produced NaN or infinite logits."""


class DivergenceError(JEMError, RuntimeError):
    """Energies became non-finite or exploded during JEM training or sampling."""


class CheckpointError(JEMError, RuntimeError):
    """A checkpoint is missing, corrupt, or does not match the object it is loaded into."""


class UnknownNameError(JEMError, KeyError):
    """A named plugin item (OOD score, init distribution, loss term, ...) does not exist."""

    def __str__(self) -> str:  # KeyError would repr() the message and add quotes
        return str(self.args[0]) if self.args else ""


class InferenceModeError(JEMError, RuntimeError):
    """Input gradients were requested on a tensor created under ``torch.inference_mode``."""


class DatasetNotFoundError(JEMError, FileNotFoundError):
    """A local dataset (image folder, CIFAR-10 copy) is missing; jem-plugin never downloads data."""


class InvalidScoresError(JEMError, ValueError):
    """Scores, probabilities or labels handed to a metric are empty, misshapen or non-finite."""


class OutOfDomainWarning(UserWarning):
    """Inputs lie outside the model's input domain (e.g. 0..255 pixels for a normalised model).

    Issued once per call site; silence it with
    ``warnings.filterwarnings("ignore", category=jem_plugin.OutOfDomainWarning)``.
    """
