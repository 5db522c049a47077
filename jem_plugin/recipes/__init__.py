"""Named JEM training recipes: one typed tree of small frozen settings that builds every piece.

A :class:`Recipe` is the whole configuration of a JEM run, said once: the sampler
(:class:`SamplerConfig`), the replay buffer and its init distribution (:class:`BufferConfig`), the
loss weights (:class:`LossConfig`), the optimiser and its warm-up (:class:`OptimConfig`),
sharpness-aware minimisation (:class:`SAMConfig`) and the BatchNorm statistics recomputed from the
data. It prints, round-trips through plain data (:meth:`Recipe.to_dict`, :meth:`Recipe.from_dict`,
``spec.json``), and :meth:`Recipe.build` turns it into explicit objects (:class:`JEMSetup`): the
sampler, buffer, loss, optimiser and extensions. :func:`jem_plugin.training.fit` runs any recipe in
full; ``jem train``'s flags and ``--config`` keys are this tree's flat names (:func:`flat_names`).
The presets (:data:`RECIPES`) are named recipes: :func:`get_recipe`, :func:`list_recipes`.

>>> import jem_plugin.recipes as R
>>> print(R.get_recipe("fast"))
>>> mine = R.get_recipe("fast").replace(sgld_steps=10, lr=1e-4)     # flat names, as jem train's flags
>>> setup = mine.build(jm, train_set, total_iters=epochs * len(loader))
"""

# The tree (its classes and what they build) and the presets (named instances of it) live in
# private modules; this namespace is the public one.
from ._presets import RECIPES, get_recipe, list_recipes
from ._tree import (
    BufferConfig,
    JEMSetup,
    LossConfig,
    OptimConfig,
    Recipe,
    SAMConfig,
    SamplerConfig,
    flat_names,
)

__all__ = [
    "SamplerConfig",
    "BufferConfig",
    "LossConfig",
    "OptimConfig",
    "SAMConfig",
    "Recipe",
    "JEMSetup",
    "RECIPES",
    "get_recipe",
    "list_recipes",
    "flat_names",
]
