"""Model files written by ``jem train`` and ``jem demo``, read back in Python: :func:`load` and
:func:`load_sampler`.

A model file (``model.pt``; ``model_JEM.pt`` and ``model_baseline.pt`` from ``jem demo``) is a
code-free checkpoint holding the spec that rebuilds the network (its ``--model``/``--data``
specs, classes, input shape and domain, a built-in net's options) and the weights. ``jem train``
writes the run's SGLD settings and replay buffer beside it (``sampler.pt``). The ``jem`` command
reads both through this module, so Python and the command rebuild a model the same way.

>>> jm = jem.load("runs/jem/model.pt")
>>> jm.log_px(x)
>>> sgld, buffer = jem.load_sampler("runs/jem/model.pt")
>>> x0 = buffer.init_dist.sample(64, buffer.sample_shape, jm.domain)  # fresh chains, as `jem sample`
>>> samples = sgld.sample(jm, x_init=x0)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .buffer import ReplayBuffer
from .checkpoint import CORRUPT, MISMATCH, MISSING, UNSAFE, load_checkpoint
from .errors import CheckpointError, JEMError
from .model import JEM, wrap
from .nets import build_model, is_factory
from .sampling import SGLD

__all__ = ["load", "load_sampler"]

CKPT_FORMAT = "jem-plugin/model/1"
SAMPLER_FORMAT = "jem-plugin/sampler/1"
# What a loaded sampler does not take from the run's: how a chain is run (CUDA graph), not what it
# draws (every other SGLD setting travels, a new one included), and the generator.
SAMPLER_NOT_REUSED = ("cuda_graph", "generator_state", "generator_device")
_WHICH = "pass the model.pt of a `jem train` run directory (model_JEM.pt or model_baseline.pt from `jem demo`)"
# Where weights trained elsewhere go: the commands that name the network for them.
_ELSEWHERE = (
    "name their network: jem eval --model NAME --weights FILE (jem ood too), or in Python build it, "
    "net.load_state_dict(...), and jem.wrap(net)"
)
#: ``trust_factory``: ``False`` (refuse a file whose network is a ``module:factory``), ``True``
#: (import and call the factory the file names), or the factory itself (called instead).
TrustFactory = bool | Callable[..., nn.Module]


def load(path: str | Path, device: Any = None, *, trust_factory: TrustFactory = False) -> JEM:
    """The model saved by ``jem train`` or ``jem demo`` at ``path``, as a :class:`JEM` in eval mode.

    The file is read with ``weights_only`` (tensors, numbers, strings: unpickling runs no code) and
    the network is rebuilt from its spec: a built-in net or a timm name, constructed by jem-plugin
    or timm. A network trained with ``--model module:factory`` is code of the user's: the file only
    names it, and loading it would import that module and call the factory with keyword arguments
    from the file. It is refused (``.reason`` ``"unsafe"``) unless ``trust_factory`` says so:
    ``True`` imports and calls the factory the file names (its module must be importable: run from
    the directory holding it, or put it on ``sys.path``); the factory itself
    (``trust_factory=mynet.build``) is called instead, and nothing is imported. The command line's
    ``--trust-factory`` is ``True``. The network is then given the run's weights; ``jm.domain`` is
    the data's domain (normalisation), ``jm.num_classes`` its class count. Also set:
    ``jm.classes``, the class names (``["0", "1", ...]`` when the data had none);
    ``jm.temperature``, the temperature ``jem train`` kept for calibrated probabilities
    (``softmax(jm(x) / jm.temperature)``), ``None`` when it kept none (the logits are the
    network's own either way); ``jm.trained_px``, whether log p(x) was trained.
    ``device``: where to put the model (default: CPU). To sample as ``jem sample`` does, see
    :func:`load_sampler`.

    Raises :class:`~jem_plugin.errors.CheckpointError`, one line: a missing file (``.reason``
    ``"missing"``), a file that is not a model file (``"corrupt"``, ``"mismatch"``), weights that do
    not fit the rebuilt network (``"mismatch"``), or a network that cannot be rebuilt (``None``:
    e.g. a factory module that cannot be imported, named with how to make it importable), or a
    ``module:factory`` network without ``trust_factory`` (``"unsafe"``).
    """
    jm, spec = read_model_file(path, device, trust_factory)
    # Plain attributes declared on JEM, not module state.
    jm.classes = list(spec.get("classes") or [str(i) for i in range(spec["num_classes"])])
    temperature = spec.get("temperature")
    jm.temperature = float(temperature) if temperature is not None else None
    return jm


def load_sampler(path: str | Path, device: Any = None) -> tuple[SGLD, ReplayBuffer]:
    """``(sgld, buffer)``: the SGLD sampler and replay buffer ``jem train`` saved beside the model
    file ``path`` (``sampler.pt`` beside ``model.pt``), to draw as ``jem sample`` does.

    ``sgld`` carries every setting of the run's sampler (steps, step size, noise, ...; not its
    CUDA-graph choice or generator), ``buffer`` the run's chains, init distribution (fitted on
    the training data) and colour axes. ``sgld.sample(jm, x_init=buffer.init_dist.sample(n,
    buffer.sample_shape, jm.domain))`` starts fresh chains from the init distribution (``jem
    sample``); ``sgld.sample(jm, n, buffer=buffer)`` continues the run's chains (``jem sample
    --from-buffer``; the chains are written back to ``buffer``, in memory). ``device``: where to put the buffer (default: CPU; sampling moves it to the
    model's device).

    Raises :class:`~jem_plugin.errors.CheckpointError` when there is no sampler file (``jem demo``
    and ``jem train --baseline`` write none) or it is not one.
    """
    found = load_run_sampler(path, device)
    if found is None:
        raise CheckpointError(
            f"no sampler file {str(sampler_file(path))!r} beside {str(path)!r}: `jem train` writes one for a JEM "
            "(not for --baseline or `jem demo`); without it sample from uniform noise with jem.SGLD().sample(jm, n)",
            reason=MISSING,
        )
    settings, buffer = found
    sgld = SGLD(**settings)
    if sgld.colours == "data":
        sgld.use_colours_of(buffer)
    return sgld, buffer


def read_model_file(
    path: str | Path, device: Any = None, trust_factory: TrustFactory = False
) -> tuple[JEM, dict[str, Any]]:
    """``(jm, spec)``: the wrapped model in eval mode and the spec it was rebuilt from
    (``trust_factory``: as :func:`load`'s)."""
    spec = _read_spec(path)
    jm = wrap_for_data(_build_network(spec, path, trust_factory), spec)
    jm.settle(num_classes=spec["num_classes"])  # a factory's plain nn.Module: known before a forward
    load_checkpoint(path, rng=False, model=jm.model)  # checks keys and shapes first
    if "trained_px" in spec:  # was log p(x) trained (jem train with the JEM loss)? The JEM-only scores ask
        jm.trained_px = bool(spec["trained_px"])
    if device is not None:
        jm.to(device)
    return jm.eval(), spec


def wrap_for_data(model, spec: dict[str, Any]) -> JEM:
    """Wrap with the data's domain: the sampler must work in the space the loader yields."""
    opts: dict[str, Any] = {"input_size": tuple(spec["sample_shape"])}
    if spec.get("mean"):
        opts.update(mean=spec["mean"], std=spec["std"])
    else:
        opts["data_range"] = (spec["low"], spec["high"])
    return wrap(model, **opts)


def sampler_file(model_path: str | Path) -> Path:
    """Where ``jem train`` puts the run's sampler beside ``model_path``: ``model.pt`` ->
    ``sampler.pt``, ``model_JEM.pt`` -> ``sampler_JEM.pt``."""
    path = Path(model_path)
    stem = path.stem
    return path.with_name(("sampler" + stem[len("model") :] if stem.startswith("model") else stem + "_sampler") + ".pt")


def load_run_sampler(model_path: str | Path, device: Any = None) -> tuple[dict[str, Any], ReplayBuffer] | None:
    """``(SGLD settings, ReplayBuffer)`` saved by ``jem train`` beside ``model_path``, or ``None``
    when there is none (a model from before this file existed, or a baseline)."""
    path = sampler_file(model_path)
    if not path.exists():
        return None
    stored = load_checkpoint(path, rng=False)
    if stored.get("kind") != SAMPLER_FORMAT:
        raise CheckpointError(f"{str(path)!r} is not a sampler file written by `jem train`", reason=MISMATCH)
    buffer = ReplayBuffer(**stored["buffer_config"])
    buffer.load_state_dict(stored["buffer"])  # a fitted init sizes its tensors on load
    if device is not None:
        buffer.to(device)
    sampler = SGLD()
    sampler.load_state_dict(dict(stored["sgld"]))  # a file from an older jem train: its spellings translated
    settings = {k: v for k, v in sampler.state_dict().items() if k not in SAMPLER_NOT_REUSED}
    return settings, buffer


def _read_spec(path: str | Path) -> dict[str, Any]:
    """The spec of a model file; one line for a missing file or one that is not a model file."""
    try:
        stored = load_checkpoint(path, rng=False)
    except CheckpointError as exc:
        if exc.reason == MISSING:
            raise CheckpointError(f"no model file at {str(path)!r}: {_WHICH}", reason=MISSING) from exc
        if exc.reason == CORRUPT:
            raise CheckpointError(_not_a_model_file(path), reason=CORRUPT) from exc
        if exc.reason == UNSAFE:
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))
            raise CheckpointError(
                f"{str(path)!r} is not a model file written by `jem train` or `jem demo` but pickled Python objects "
                f"({found[1] + ': ' if found else ''}a whole model saved with torch.save(model)?), which jem does "
                "not unpickle, since that can run code; save the weights alone, torch.save(model.state_dict(), "
                f"FILE), and {_ELSEWHERE}",
                reason=UNSAFE,
            ) from None
        raise
    if stored.get("kind") != CKPT_FORMAT:
        what = "the run's sampler file" if stored.get("kind") == SAMPLER_FORMAT else "a jem-plugin checkpoint"
        raise CheckpointError(
            f"{str(path)!r} is {what}, not a model file written by `jem train` or `jem demo`; {_WHICH}",
            reason=MISMATCH,
        )
    return stored["spec"]


def _not_a_model_file(path: str | Path) -> str:
    """One line for a file ``load_checkpoint`` could not read as a jem-plugin checkpoint: weights
    trained elsewhere (a state_dict, or a training checkpoint holding one) are pointed to
    ``--model NAME --weights FILE``; anything else to a model file."""
    try:  # again, weights_only: only a failed load pays for the second read
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # damaged, or not torch's: any failure means the same to the user
        obj = None
    head = f"{str(path)!r} is not a model file written by `jem train` or `jem demo`"
    if isinstance(obj, dict) and _is_state_dict(obj):
        held = "a network's weights alone (a state_dict)"
    elif isinstance(obj, dict) and any(isinstance(v, dict) and _is_state_dict(v) for v in obj.values()):
        key = next(k for k, v in obj.items() if isinstance(v, dict) and _is_state_dict(v))
        held = f"a training checkpoint holding a network's weights (under {key!r})"
    else:
        return f"{head} (not a jem-plugin checkpoint, or damaged); {_WHICH}"
    return f"{head} but {held}, which do not say what network they fit; {_ELSEWHERE}"


def _is_state_dict(d: dict) -> bool:
    return bool(d) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in d.items())


def _build_network(spec: dict[str, Any], path: str | Path, trust_factory: TrustFactory) -> nn.Module:
    model = spec["model"]
    if is_factory(model) and trust_factory is False:
        # The file only names code: importing and calling it is the user's decision, not the file's.
        module, _, attr = model.partition(":")
        raise CheckpointError(
            f"{str(path)!r} was trained with the network factory {model}: loading it would import {module} and call "
            f"{attr}() with arguments from the file, which jem does not do unless told to; if you trust that code, "
            "pass trust_factory=True to jem.load (--trust-factory to jem eval, jem ood and jem sample)",
            reason=UNSAFE,
        )
    factory = trust_factory if callable(trust_factory) else None
    if factory is not None and not is_factory(model):
        raise CheckpointError(
            f"{str(path)!r} holds the network {model}, which jem-plugin builds itself; trust_factory takes a factory "
            "only for a file trained with --model module:factory (drop it)",
            reason=MISMATCH,
        )
    try:
        return build_model(
            model, spec["num_classes"], spec["sample_shape"][0], spec.get("model_options"), factory=factory
        )
    except JEMError as exc:
        cause = exc.__cause__
        if ":" in model and isinstance(cause, (ImportError, AttributeError)):
            module = model.partition(":")[0]
            raise CheckpointError(
                f"{str(path)!r} was trained with the network factory {model}, which cannot be imported ({cause}): "
                f"run from the directory holding {module.replace('.', '/')}.py, or put that directory on "
                "sys.path (PYTHONPATH)"
            ) from exc
        raise CheckpointError(f"cannot rebuild the network of {str(path)!r} (--model {model}): {exc}") from exc
