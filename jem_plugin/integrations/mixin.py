"""JEM's generative loss for class-based training loops: :class:`GenerativeLossMixin`.

Mix it into any ``nn.Module`` (a ``LightningModule``, a Hugging Face ``Trainer`` model, a plain
module) and call :meth:`~GenerativeLossMixin.generative_loss` in the training step.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..losses import JEMLoss, LossOutput
from ..model import JEM, wrap

__all__ = ["GenerativeLossMixin"]


class GenerativeLossMixin:
    """Add JEM's generative loss to a class-based training loop (LightningModule, Trainer, any module).

    >>> class Classifier(GenerativeLossMixin, nn.Module):     # or a LightningModule, ...
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.backbone = torchvision.models.resnet18(num_classes=10)
    ...         self.configure_jem("backbone", buffer=ReplayBuffer(10000, (3, 32, 32)), l2_weight=0.1)
    >>> model = Classifier()
    >>> out = model.generative_loss(x, y)      # out.loss to backpropagate, out.metrics to log

    :meth:`configure_jem` creates ``self.jem_loss`` (a :class:`JEMLoss` submodule, so the replay
    buffer and sampler state are in the module's own ``state_dict``) and ``self.jem``, the energy
    view of the classifier. ``self.jem`` is deliberately not a registered submodule: the classifier
    is already one, and registering it twice would duplicate its weights in the ``state_dict``.
    """

    def configure_jem(
        self,
        classifier: nn.Module | str | JEM,
        sampler: Any = None,
        buffer: nn.Module | None = None,
        *,
        wrap_options: dict | None = None,
        **loss_kwargs: Any,
    ) -> JEMLoss:
        """Set up JEM on ``classifier`` (a module, its JEM view, or an attribute name such as
        ``"net"`` or ``"backbone.model"``); ``sampler``, ``buffer`` (a
        :class:`~jem_plugin.buffer.ReplayBuffer`, which a loss that draws samples needs) and
        ``loss_kwargs`` go to :class:`JEMLoss`."""
        if not isinstance(self, nn.Module):
            raise TypeError("GenerativeLossMixin must be mixed into an nn.Module subclass")
        if "_modules" not in self.__dict__:
            raise TypeError("call configure_jem() after nn.Module.__init__ (i.e. after super().__init__())")
        if isinstance(classifier, str):
            target: Any = self
            for part in classifier.split("."):
                if not hasattr(target, part):
                    raise AttributeError(
                        f"configure_jem({classifier!r}): {type(target).__name__} has no attribute "
                        f"{part!r}; create the classifier before calling configure_jem"
                    )
                target = getattr(target, part)
            classifier = target
        if isinstance(classifier, JEM):
            jm = classifier
        elif isinstance(classifier, nn.Module) or callable(classifier):
            jm = wrap(classifier, **(wrap_options or {}))
        else:
            raise TypeError(f"configure_jem needs a classifier module, got {type(classifier).__name__}")
        object.__setattr__(self, "_jem_view", jm)  # bypasses nn.Module registration on purpose
        self.jem_loss = JEMLoss(sampler=sampler, buffer=buffer, **loss_kwargs)
        return self.jem_loss

    @property
    def jem(self) -> JEM:
        """The energy view of the classifier given to :meth:`configure_jem`."""
        view = self.__dict__.get("_jem_view")
        if view is None:
            raise AttributeError("call self.configure_jem(classifier) before using self.jem")
        return view

    def generative_loss(self, x: Tensor, y: Tensor) -> LossOutput:
        """The JEM loss of a batch: ``out.loss`` to backpropagate, ``out.metrics`` to log."""
        if "jem_loss" not in getattr(self, "_modules", {}):
            raise AttributeError("call self.configure_jem(classifier) before generative_loss()")
        return self.jem_loss(self.jem, x, y)
