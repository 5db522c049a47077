"""jem-plugin: any PyTorch classifier as a Joint Energy-based Model (Grathwohl et al. 2019).

>>> import jem_plugin as jem
>>> jm = jem.wrap(model)          # the same network, read as an energy model
>>> jm.log_px(x)                  # unnormalised log p(x) = logsumexp f(x)
"""

from __future__ import annotations

from . import calibration, ood, robustness  # noqa: E402  (namespaces: jem.ood.score, ...)
from .adapter import Adapter, InputDomain
from .buffer import ReplayBuffer
from .checkpoint import Checkpointer, load_checkpoint, save_checkpoint
from .errors import (
    CheckpointError,
    CUDAGraphError,
    DatasetNotFoundError,
    DivergenceError,
    InferenceModeError,
    InvalidInputError,
    InvalidLabelError,
    InvalidScoresError,
    JEMError,
    NoFeaturesError,
    NoLogitsError,
    NonFiniteLogitsError,
    NotFittedError,
    NotWrappedError,
    OutOfDomainWarning,
    UnknownNameError,
    UntrainedDensityWarning,
)
from .integrations.mixin import GenerativeLossMixin
from .loading import load, load_sampler
from .losses import JEMLoss, LossOutput
from .model import JEM, as_jem, input_grad_enabled, wrap
from .plugins import get_plugin_manager, hookimpl, list_plugins, register, unregister
from .recipes import Recipe, get_recipe, list_recipes
from .sampling import SGLD, SGLDDiagnostics, SGLDStepState
from .stability import DivergenceGuard
from .training import FitOptions, fit

__version__ = "0.2.0"

__all__ = [
    "JEM",
    "wrap",
    "load",
    "load_sampler",
    "as_jem",
    "Adapter",
    "InputDomain",
    "input_grad_enabled",
    "SGLD",
    "SGLDStepState",
    "SGLDDiagnostics",
    "ReplayBuffer",
    "JEMLoss",
    "LossOutput",
    "Recipe",
    "get_recipe",
    "list_recipes",
    "fit",
    "FitOptions",
    "GenerativeLossMixin",
    "DivergenceGuard",
    "Checkpointer",
    "save_checkpoint",
    "load_checkpoint",
    "ood",
    "calibration",
    "robustness",
    "hookimpl",
    "register",
    "unregister",
    "list_plugins",
    "get_plugin_manager",
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
    "UntrainedDensityWarning",
]
