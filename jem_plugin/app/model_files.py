"""Model files: how ``jem train`` and ``jem demo`` store a model and how every command rebuilds it.

A model file is a code-free checkpoint (``weights_only``) holding the spec needed to rebuild the
network (``--model``/``--data`` specs, classes, input shape and domain, a built-in net's options)
and its weights. ``--data`` specs are read here too, since a spec names its data.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from . import CLIError

# Model specs understood by --model: built-in nets, any timm name, or module:factory.
BUILTIN_NETS = ("digits-cnn", "toy-mlp", "wrn28-10", "wrn-D-K")
_WRN = re.compile(r"wrn-?(\d+)-(\d+)")  # wrn28-10, wrn-16-8: WideResNet(depth, widen_factor)
CKPT_FORMAT = "jem-plugin/model/1"


def load_data(spec: str, *, train: bool = True, image_size: int = 32, seed: int = 0):
    """``(dataset, domain, num_classes, sample_shape)`` for a ``--data`` spec.

    Specs: ``digits``, ``toy2d`` (or ``toy2d:NAME``), ``folder:PATH``, ``cifar10:PATH``.
    """
    from . import data

    kind, _, arg = spec.partition(":")
    if kind == "digits":
        ds = data.load_digits("train" if train else "test", seed=seed)
        return ds, ds.domain, 10, (1, 8, 8)
    if kind == "toy2d":
        from torch.utils.data import TensorDataset

        x, y = data.toy2d(arg or "8gaussians", n=4000 if train else 1000, seed=seed if train else seed + 1)
        ds = TensorDataset(x, y)
        from ..adapter import InputDomain

        lim = float(x.abs().max()) * 1.2
        return ds, InputDomain.from_range(-lim, lim, input_size=(2,)), int(y.max()) + 1, (2,)
    if kind == "folder":
        if not arg:
            raise CLIError("--data folder:PATH needs a path, e.g. folder:data/train")
        ds = data.image_folder(arg, image_size=image_size)
        return ds, ds.domain, len(ds.classes), (3, image_size, image_size)
    if kind == "cifar10":
        if not arg:
            raise CLIError("--data cifar10:PATH needs the directory holding cifar-10-batches-py")
        ds = data.cifar10(arg, train=train)
        return ds, ds.domain, 10, (3, 32, 32)
    raise CLIError(f"unknown --data {spec!r}; use digits, toy2d[:NAME], folder:PATH or cifar10:PATH")


def build_model(spec: str, num_classes: int, in_chans: int, options: dict[str, Any] | None = None):
    """An ``nn.Module`` for a ``--model`` spec: a built-in net, a timm name, or ``module:factory``.

    ``options``: constructor keywords of a built-in net (e.g. ``{"width": 16}`` for digits-cnn).
    ``wrn28-10`` / ``wrn-D-K``: the JEM paper's Wide-ResNet (depth D, widen factor K, no normalisation).
    """
    from . import nets

    if spec == "digits-cnn":
        return nets.DigitsCNN(num_classes=num_classes, **(options or {}))
    if spec == "toy-mlp":
        return nets.ToyMLP(num_classes=num_classes, **(options or {}))
    wrn = _WRN.fullmatch(spec)
    if wrn:
        try:
            return nets.WideResNet(int(wrn[1]), int(wrn[2]), num_classes, in_channels=in_chans, **(options or {}))
        except ValueError as exc:
            raise CLIError(f"--model {spec}: {exc}") from exc
    if ":" in spec:
        import importlib

        modname, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(modname), attr)
        except (ImportError, AttributeError) as exc:
            raise CLIError(f"cannot load --model {spec!r}: {exc}") from exc
        return factory(num_classes=num_classes)
    import timm

    if not timm.is_model(spec):
        raise CLIError(
            f"unknown --model {spec!r}: not a built-in ({', '.join(BUILTIN_NETS)}), not a timm "
            "model name (see timm.list_models()), and not a module:factory path")
    return timm.create_model(spec, pretrained=False, num_classes=num_classes, in_chans=in_chans)


def model_spec(model: str, data: str, num_classes: int, sample_shape, domain,
               model_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a model file stores to rebuild the model: the ``--model``/``--data`` specs, the
    classes, the input shape, the input domain, and a built-in net's constructor options."""
    spec = {"model": model, "data": data, "num_classes": num_classes, "sample_shape": list(sample_shape),
            "low": list(domain.low), "high": list(domain.high),
            "mean": list(domain.mean) if domain.mean else None,
            "std": list(domain.std) if domain.std else None}
    if model_options:
        spec["model_options"] = dict(model_options)
    return spec


def save_model_checkpoint(path: Path, jm, spec: dict[str, Any]) -> None:
    """The final model: its spec (to rebuild it) and weights, atomic and code-free."""
    from ..checkpoint import save_checkpoint

    save_checkpoint(path, rng=False, kind=CKPT_FORMAT, spec=spec, model=jm.model)


def load_model_checkpoint(path: str, device=None):
    """Rebuild the wrapped model saved by ``jem train`` or ``jem demo``; returns ``(jm, spec)``."""
    from ..checkpoint import load_checkpoint

    stored = load_checkpoint(path, rng=False)  # CheckpointError: missing, corrupt, unsafe
    if stored.get("kind") != CKPT_FORMAT:
        raise CLIError(f"{path!r} is not a model checkpoint written by `jem train` or `jem demo` "
                       "(use the model*.pt in the run directory)")
    spec = stored["spec"]
    model = build_model(spec["model"], spec["num_classes"], spec["sample_shape"][0], spec.get("model_options"))
    jm = wrap_for_data(model, spec)
    load_checkpoint(path, rng=False, model=jm.model)  # checks keys and shapes first
    if device is not None:
        jm.to(device)
    return jm.eval(), spec


def wrap_for_data(model, spec: dict[str, Any]):
    """Wrap with the data's domain: the sampler must work in the space the loader yields."""
    from .. import wrap

    opts: dict[str, Any] = {"input_size": tuple(spec["sample_shape"])}
    if spec.get("mean"):
        opts.update(mean=spec["mean"], std=spec["std"])
    else:
        opts["data_range"] = (spec["low"], spec["high"])
    return wrap(model, **opts)
