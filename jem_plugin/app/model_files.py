"""Model files: how ``jem train`` and ``jem demo`` store a model and how every command rebuilds it.

A model file is a code-free checkpoint (``weights_only``) holding the spec needed to rebuild the
network (``--model``/``--data`` specs, classes, input shape and domain, a built-in net's options)
and its weights. ``--data`` specs are read here too, since a spec names its data. Reading a model
file back is the library's (:mod:`jem_plugin.loading`, ``jem.load``): one copy, which the commands
use; the network a ``--model`` spec names is built by :func:`jem_plugin.nets.build_model`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Subset, TensorDataset

from .._checks import model_device
from ..adapter import InputDomain
from ..checkpoint import save_checkpoint
from ..loading import CKPT_FORMAT, SAMPLER_FORMAT, SAMPLER_NOT_REUSED, read_model_file, sampler_file
from ..loading import load_run_sampler as load_run_sampler
from ..loading import wrap_for_data as wrap_for_data
from ..nets import WRN_SPEC
from . import CLIError
from . import data as D


def load_data(
    spec: str,
    *,
    train: bool = True,
    image_size: int = 32,
    seed: int = 0,
    skip_bad: bool = False,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    channels: int = 3,
    notes: bool = True,
):
    """``(dataset, domain, num_classes, sample_shape)`` for a ``--data`` spec.

    Images (folders, CIFAR-10) are normalised by ``mean``/``std`` where given (a user's own
    classifier, ``jem ood --weights``), else into ``[-1, 1]`` as ``jem train`` reads them. A
    folder's images are read in ``channels`` (a model's: 1 grey, 3 RGB; jem train builds RGB models),
    and what was converted or skipped is said on stderr (``notes=False``: the caller says it once
    its checks passed, so that a mistake still ends in one line).

    Specs: ``digits``, ``toy2d`` (or ``toy2d:NAME``), ``textures`` (or ``textures:N``, N generated
    images per class, default 500; 100 per class for testing), ``folder:PATH``, ``cifar10:PATH``.
    A folder's unreadable images end the load in one line naming the first, or with ``skip_bad``
    are left out, said in one line on stderr (``--skip-bad-images``).
    """
    kind, _, arg = spec.partition(":")
    if kind == "digits":
        digits = D.load_digits("train" if train else "test", seed=seed)
        return digits, D.DIGITS_DOMAIN, 10, (1, 8, 8)
    if kind == "toy2d":
        x, y = D.toy2d(arg or "8gaussians", n=4000 if train else 1000, seed=seed if train else seed + 1)
        ds = TensorDataset(x, y)
        ds.classes = [str(i) for i in range(int(y.max()) + 1)]  # type: ignore[attr-defined]  # class names on a plain dataset, as torchvision's datasets carry them
        lim = float(x.abs().max()) * 1.2
        return ds, InputDomain.from_range(-lim, lim, input_size=(2,)), int(y.max()) + 1, (2,)
    if kind == "folder":
        if not arg:
            raise CLIError("--data folder:PATH needs a path, e.g. folder:data/train")
        # the model's channels (jem train's: 3); an image in another mode is converted, and said
        ds = D.image_folder(arg, image_size=image_size, mean=mean, std=std, skip_bad=skip_bad, channels=channels)
        if notes:
            _say_skipped(ds, spec)
        return ds, ds.domain, len(ds.classes), (channels, image_size, image_size)
    if kind == "textures":  # generated colour shapes on textures (data.textures): train 0.., test 1000000..
        try:
            n = int(arg or 500) if train else 100
        except ValueError:
            raise CLIError(f"--data {spec!r}: use textures or textures:N (N images per class)") from None
        x, y = D.textures(n, size=image_size, seed=seed, offset=0 if train else 1_000_000)
        ds = TensorDataset(x * 2.0 - 1.0, y)  # [0, 1] -> the paper's [-1, 1], as a folder is read
        ds.classes = [f"{k}_{c}" for k, c in enumerate(D.TEXTURE_CLASSES)]  # type: ignore[attr-defined]  # class names on a plain dataset, as torchvision's datasets carry them
        return ds, D.signed_domain(3, (3, image_size, image_size)), 10, (3, image_size, image_size)
    if kind == "cifar10":
        if not arg:
            raise CLIError("--data cifar10:PATH needs the directory holding cifar-10-batches-py")
        ds = D.cifar10(arg, train=train, mean=mean, std=std)
        return ds, ds.domain, 10, (3, 32, 32)
    raise CLIError(f"unknown --data {spec!r}; use digits, toy2d[:NAME], textures[:N], folder:PATH or cifar10:PATH")


# The notes a command said already: a command reading one folder twice (jem ood and jem sample read
# a run's folder for its held-out split and again for its training part) says each once.
_SAID: ContextVar[set[str] | None] = ContextVar("_SAID", default=None)


@contextmanager
def notes_once() -> Iterator[None]:
    """Within it (one ``jem`` command), each note on a folder's images is said once."""
    token = _SAID.set(set())
    try:
        yield
    finally:
        _SAID.reset(token)


def _say_skipped(ds, where: str) -> None:
    said = _SAID.get()
    for note in (D.skipped_note(ds, where), D.conversion_note(ds, where)):
        if note and (said is None or note not in said):
            print(f"jem: {note}", file=sys.stderr)  # stderr: eval and ood print their JSON on stdout
            if said is not None:
                said.add(note)


#: --model when none is given: the built-in net made for the bundled data, else a small timm CNN.
DEFAULT_MODELS = {"digits": "digits-cnn", "toy2d": "toy-mlp"}
DEFAULT_IMAGE_MODEL = "resnet10t"


def default_model_for(data: str) -> str:
    """The ``--model`` ``jem train`` uses for ``--data`` ``data`` when none is given."""
    return DEFAULT_MODELS.get(data.partition(":")[0], DEFAULT_IMAGE_MODEL)


def model_spec(
    model: str,
    data: str,
    num_classes: int,
    sample_shape,
    domain,
    model_options: dict[str, Any] | None = None,
    classes: Sequence[str] | None = None,
    held_out: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a model file stores to rebuild the model: the ``--model``/``--data`` specs, the
    classes (count and names), the input shape, the input domain, a built-in net's constructor
    options, and which data was held out from training (``held_out``: ``{"fraction", "seed",
    "n_total"}`` of a split, or ``{"data": SPEC}``)."""
    spec = {
        "model": model,
        "data": data,
        "num_classes": num_classes,
        "sample_shape": list(sample_shape),
        "low": list(domain.low),
        "high": list(domain.high),
        "mean": list(domain.mean) if domain.mean else None,
        "std": list(domain.std) if domain.std else None,
        "classes": [str(c) for c in classes] if classes is not None else [str(i) for i in range(num_classes)],
    }
    if model_options:
        spec["model_options"] = dict(model_options)
    if held_out:
        spec["held_out"] = dict(held_out)
    return spec


def dataset_labels(ds) -> list[int]:
    """Every label of a dataset, without loading its images."""
    if hasattr(ds, "targets"):
        return [int(t) for t in ds.targets]
    if hasattr(ds, "tensors"):
        return ds.tensors[1].tolist()
    return [int(ds[i][1]) for i in range(len(ds))]


def split_held_out(ds, fraction: float, seed: int):
    """``(train, held_out)`` subsets: a stratified, seeded split keeping ``fraction`` of each class aside."""
    from sklearn.model_selection import train_test_split

    if not 0.0 < fraction < 1.0:
        raise CLIError(f"--val-fraction must be between 0 and 1 (got {fraction}); 0 keeps nothing aside")
    labels = dataset_labels(ds)
    counts = {c: labels.count(c) for c in set(labels)}
    stratify = labels if min(counts.values()) >= 2 and round(fraction * len(labels)) >= len(counts) else None
    try:
        tr, va = train_test_split(list(range(len(labels))), test_size=fraction, random_state=seed, stratify=stratify)
    except ValueError as exc:
        raise CLIError(
            f"cannot keep {fraction:g} of {len(labels)} images aside ({exc}); add images or "
            "pass --val-fraction 0 with --val-data folder:PATH"
        ) from exc
    return Subset(ds, sorted(tr)), Subset(ds, sorted(va))


def check_training_split(
    ds, num_classes: int, batch_size: int, *, data: str, fits_init: bool, classes: Sequence[str] | None = None
) -> str | None:
    """Refuse, before training, a training split that cannot make a classifier or fit the init
    distribution, naming what to change; returns one line of advice for a very short epoch."""
    if num_classes < 2:
        raise CLIError(f"--data {data} has {num_classes} class: a classifier needs at least two (one folder per class)")
    counts = [0] * num_classes
    for label in dataset_labels(ds):
        counts[label] += 1
    names = list(classes or range(num_classes))
    empty = [str(names[c]) for c, n in enumerate(counts) if n == 0]
    if empty:
        raise CLIError(
            f"--data {data}: no training images left for class {', '.join(empty)} after the held-out split; "
            "add images or lower --val-fraction"
        )
    if fits_init and min(counts) < 2:
        few = [str(names[c]) for c, n in enumerate(counts) if n < 2]
        raise CLIError(
            f"--data {data}: class {', '.join(few)} has one training image, too few to fit the recipe's per-class "
            "Gaussian init; add images, or use --recipe paper (uniform init)"
        )
    per_epoch = len(ds) // batch_size
    if per_epoch < 10:
        return (
            f"{len(ds)} training images at --batch-size {batch_size} give {per_epoch} iterations per epoch "
            f"({min(counts)}-{max(counts)} images per class); the learning-rate warm-up and the replay buffer "
            "are sized for the run's iterations, so --epochs, not the epoch, sets how long the chains train"
        )
    return None


def check_classes(model_classes: Sequence[str], data_classes: Sequence[str], where: str) -> None:
    """A data set labelled with other classes than the model's would shift every label: refuse it."""
    if list(model_classes) != list(data_classes):
        missing = [c for c in model_classes if c not in data_classes]
        extra = [c for c in data_classes if c not in model_classes]
        detail = "; ".join(
            p
            for p in (
                f"missing {', '.join(missing)}" if missing else "",
                f"unknown {', '.join(extra)}" if extra else "",
            )
            if p
        )
        raise CLIError(
            f"{where} has classes [{', '.join(data_classes)}] but the model was trained on "
            f"[{', '.join(model_classes)}] ({detail or 'different order'}); give a folder with "
            "one sub-directory per training class"
        )


def check_shape(spec: dict[str, Any], shape, data: str) -> None:
    """Data of another shape than the model's training data: one line naming the data to use."""
    if spec.get("sample_shape") and tuple(spec["sample_shape"]) != tuple(shape):
        raise CLIError(
            f"the model (trained on --data {spec['data']}) takes inputs of shape "
            f"{tuple(spec['sample_shape'])}, --data {data} gives {tuple(shape)}; evaluate on data "
            f"like its training data (--data {spec['data']}, or --image-size "
            f"{spec['sample_shape'][-1]} for a folder)"
        )


def check_inputs(jm, x, spec: dict[str, Any], data: str) -> None:
    """One forward pass on a data batch, so a model/data size mismatch is one line naming the fix."""
    check_shape(spec, x.shape[1:], data)
    try:
        with torch.no_grad():
            out = jm.model(x[:2].to(model_device(jm)))
    except (RuntimeError, AssertionError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        model = spec["model"]
        made_for = {net: data for data, net in DEFAULT_MODELS.items()}  # digits-cnn -> digits, ...
        if model in made_for:
            hint = (
                f"{model} is made for --data {made_for[model]}; for other images use a timm model, "
                f"e.g. --model {DEFAULT_IMAGE_MODEL}"
            )
        elif ":" in model or WRN_SPEC.fullmatch(model):  # a factory's net, or the paper's Wide-ResNet
            hint = "make the model accept this input size, or change --image-size"
        else:
            size = (getattr(jm.model, "pretrained_cfg", None) or {}).get("input_size", (0, 224))[-1]
            hint = (
                f"it expects {size}x{size} inputs; use a convolutional model (e.g. --model resnet10t), or "
                f"folder data with --image-size {size}"
            )
        raise CLIError(
            f"--model {model} fails on inputs of shape {tuple(x.shape[1:])} from --data {data} ({first[:160]}): {hint}"
        ) from exc
    if getattr(out, "ndim", 0) != 2 or out.shape[1] != spec["num_classes"]:
        raise CLIError(
            f"--model {spec['model']} returns shape {tuple(getattr(out, 'shape', ()))}, not "
            f"[batch, {spec['num_classes']}] logits; its factory must honour num_classes"
        )


def training_data(spec: dict[str, Any], seed: int = 0, skip_bad: bool = False):
    """The data a model was trained on, from its spec: the training split of its ``--data``, with
    the part a folder run held out left out (what ``jem train`` trained on). Its unreadable images
    are skipped when the run skipped them (``--skip-bad-images``) or ``skip_bad`` says so."""
    skip = skip_bad or bool(spec.get("skip_bad_images"))
    ds, *_ = load_data(spec["data"], train=True, image_size=int(spec["sample_shape"][-1]), seed=seed, skip_bad=skip)
    kept = spec.get("held_out") or {}
    if spec["data"].startswith("folder:") and kept.get("fraction"):
        ds, _ = split_held_out(ds, kept["fraction"], kept.get("seed", 0))
    return ds


def held_out_data(
    spec: dict[str, Any], data: str | None, image_size: int | None, seed: int = 0, skip_bad: bool = False
):
    """``(dataset, description)`` to evaluate a model on: ``data`` when given, else what training
    held out (the split of its folder, its --val-data, or the data set's own test split). Unreadable
    images are skipped with ``skip_bad``, and in the run's own data when the run skipped them."""
    size = image_size or int(spec["sample_shape"][-1])
    own = skip_bad or bool(spec.get("skip_bad_images"))
    if data:
        # a folder read in the model's channels, as jem ood reads an --ood folder (a grey model, RGB images)
        channels = int(spec["sample_shape"][0]) if len(spec["sample_shape"]) == 3 else 3
        ds, *_ = load_data(
            data,
            train=False,
            image_size=size,
            seed=seed,
            skip_bad=skip_bad,
            mean=spec.get("mean"),
            std=spec.get("std"),
            channels=channels,
            notes=False,  # said below, once the shape and classes fit
        )
        where = data
    else:
        kept = spec.get("held_out") or {}
        source = spec["data"]
        if kept.get("data"):
            ds, *_ = load_data(kept["data"], train=False, image_size=size, seed=seed, skip_bad=own)
            where = f"{kept['data']} (the run's --val-data)"
        elif source.startswith("folder:"):
            if not kept.get("fraction"):
                raise CLIError(
                    f"this model was trained on all of {source} (--val-fraction 0); "
                    "evaluate it on other images with --data folder:PATH"
                )
            full, *_ = load_data(source, train=False, image_size=size, seed=seed, skip_bad=own)
            if len(full) != kept.get("n_total", len(full)):
                raise CLIError(
                    f"{source} holds {len(full)} images, {kept['n_total']} when the model was "
                    "trained, so its held-out split is lost; evaluate with --data folder:PATH"
                )
            _, ds = split_held_out(full, kept["fraction"], kept.get("seed", 0))
            ds.classes = full.classes
            where = f"{source}, the {kept['fraction']:g} held out from training"
        else:
            ds, *_ = load_data(source, train=False, image_size=size, seed=seed, skip_bad=own)
            where = f"{source} (test split)"
    if len(ds):
        check_shape(spec, ds[0][0].shape, data or spec["data"])
    if spec.get("classes") and hasattr(ds, "classes") and (data or "").startswith(("folder:", "cifar10:")):
        check_classes(spec["classes"], [str(c) for c in ds.classes], f"--data {data}")
    if data and data.startswith("folder:"):
        _say_skipped(ds, data)
    return ds, where


def save_model_checkpoint(path: Path, jm, spec: dict[str, Any]) -> None:
    """The final model: its spec (to rebuild it) and weights, atomic and code-free. The spec also
    records whether log p(x) was trained (``JEMLoss`` marks the model), which the gradient and
    SGLD scores ask when the file is loaded."""
    spec = {**spec, "trained_px": bool(jm.trained_px)}
    save_checkpoint(path, rng=False, kind=CKPT_FORMAT, spec=spec, model=jm.model)


def load_model_checkpoint(path: str, device=None, trust_factory: bool = False):
    """Rebuild the wrapped model saved by ``jem train`` or ``jem demo``; returns ``(jm, spec)``
    (:func:`jem_plugin.loading.read_model_file`: a ``CheckpointError`` for a file that is not one,
    or whose ``module:factory`` network ``--trust-factory`` did not allow)."""
    return read_model_file(path, device, trust_factory)


def resumed_spec(out: Path, no_resume: bool = False) -> dict[str, Any] | None:
    """The spec of the run that ``jem train --out out`` would continue, or None (a fresh run)."""
    old = out / "spec.json"
    if no_resume or not old.is_file() or not list((out / "checkpoints").glob("*.pt")):
        return None
    return json.loads(old.read_text())


def check_resume(out: Path, spec: dict[str, Any], no_resume: bool = False) -> dict[str, Any] | None:
    """A run directory holding another model's checkpoints is refused before any file is written.
    Returns the spec of the run being continued (None for a fresh run)."""
    before = resumed_spec(out, no_resume)
    if before is None:
        return None
    diff = [k for k in ("model", "data", "num_classes", "sample_shape", "classes") if before.get(k) != spec.get(k)]
    if diff:
        raise CLIError(
            f"--out {out} holds a run of --model {before.get('model')} on --data {before.get('data')} "
            f"(differs in {', '.join(diff)}); pass the same flags to resume it, --no-resume to "
            "start over there, or another --out"
        )
    return before


def drop_buffer_from_checkpoints(buffer) -> None:
    """--checkpoint-buffer none: checkpoints leave out the replay buffer's chains; a resumed run
    keeps its freshly initialised buffer (chains restart from the init distribution)."""

    def drop(module, state, prefix, local_metadata):
        state.pop(prefix + "data", None)
        state.pop(prefix + "initialized", None)

    def keep_fresh(module, state, prefix, *args):
        state[prefix + "data"] = buffer.data
        state[prefix + "initialized"] = buffer.initialized

    buffer.register_state_dict_post_hook(drop)
    buffer.register_load_state_dict_pre_hook(keep_fresh)


def ood_sets(
    items: Sequence[str] | None, spec: dict[str, Any], jm, x, y, seed: int = 0, skip_bad: bool = False
) -> dict[str, Any]:
    """``jem ood``'s OOD sets: ``noise`` and ``folder:PATH`` items (named by the folder; its images
    directly in it or in sub-folders: an OOD set has no classes), or the defaults (the digits'
    four sets, else uniform noise)."""
    if not items:
        if spec["data"].startswith("digits"):
            return D.digits_ood_sets(x, y, seed=seed)
        items = ["noise"]
    sets: dict[str, Any] = {}
    for item in items:
        if item == "noise":
            sets["noise"] = jm.domain.uniform(len(x), x.shape[1:], generator=torch.Generator().manual_seed(seed))
            continue
        if not item.startswith("folder:") or not item[len("folder:") :]:
            raise CLIError(f"--ood {item!r}: use noise or folder:PATH (a folder of images, any sub-folders)")
        ds = D.image_files(
            item[len("folder:") :],
            image_size=int(spec["sample_shape"][-1]),
            mean=spec.get("mean"),
            std=spec.get("std"),
            skip_bad=skip_bad,
            channels=int(spec["sample_shape"][0]),  # the model's: a grey model scores grey images
        )
        _say_skipped(ds, item)
        name = Path(item[len("folder:") :]).name or item
        while name in sets:
            name += "'"
        sets[name] = torch.stack([ds[i][0] for i in range(len(ds))])
        check_inputs(jm, sets[name], spec, item)
    return sets


def save_run_sampler(model_path: Path, loss_fn) -> Path:
    """The run's SGLD settings and its replay buffer (chains, fitted init distribution, colour
    axes) beside the model, so ``jem sample`` draws as the run drew."""
    settings = {k: v for k, v in loss_fn.sampler.state_dict().items() if k not in SAMPLER_NOT_REUSED}
    return save_checkpoint(
        sampler_file(model_path),
        rng=False,
        kind=SAMPLER_FORMAT,
        sgld=settings,
        buffer_config=loss_fn.buffer.config(),
        buffer=loss_fn.buffer,
    )
