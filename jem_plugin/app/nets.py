"""The small reference networks, where the examples, the demo and the tests import them from.

They live in the library, :mod:`jem_plugin.nets`, since :func:`jem_plugin.load` rebuilds the
built-in nets a model file names.
"""

from ..nets import DigitsCNN, ToyMLP, WideResNet

__all__ = ["DigitsCNN", "ToyMLP", "WideResNet"]
