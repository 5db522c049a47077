"""Atomic, code-free checkpoints that resume a JEM run exactly.

A JEM run's state is more than its weights: the replay buffer (persistent SGLD chains), the
sampler, the optimizer and every random number generator decide what happens next. Saving
all of them and restoring all of them is what makes a run killed with SIGKILL continue
bit for bit as if it had never stopped.

* Writes are atomic: the file is written to a temporary file in the same directory, flushed,
  ``fsync``-ed and moved over the target with :func:`os.replace`. A crash or kill during the
  write leaves the previous checkpoint untouched.
* Loading uses ``torch.load(..., weights_only=True)`` only: tensors, numbers, strings and
  containers. A file that asks the unpickler to build any other object (and so could run
  code) is refused with :class:`~jem_plugin.errors.CheckpointError`.
* A missing, corrupt, truncated or mismatched checkpoint is a :class:`CheckpointError`
  naming the file, the object and the first mismatches.

>>> save_checkpoint("run/ckpt.pt", model=jm, optimizer=opt, loss=loss_fn, step=step)
>>> extra = load_checkpoint("run/ckpt.pt", model=jm, optimizer=opt, loss=loss_fn)
>>> step = extra["step"]
"""

from __future__ import annotations

import os
import pickle
import random
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .errors import CheckpointError
from .model import JEM

__all__ = ["save_checkpoint", "load_checkpoint", "Checkpointer", "get_rng_state", "set_rng_state"]

FORMAT = "jem-plugin-checkpoint"
VERSION = 1

# CheckpointError.reason values, so callers (and Checkpointer.resume) can tell a damaged file
# from a checkpoint that does not fit the objects it is loaded into.
MISSING, CORRUPT, UNSAFE, MISMATCH = "missing", "corrupt", "unsafe", "mismatch"


def _error(reason: str, message: str) -> CheckpointError:
    return CheckpointError(message, reason=reason)


# --------------------------------------------------------------------------- RNG state
def get_rng_state() -> dict[str, Any]:
    """The global RNG states of torch (CPU and every CUDA device), numpy and ``random``.

    Everything is converted to tensors, ints and tuples so it loads with ``weights_only=True``.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": int(version), "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states returned by :func:`get_rng_state`."""
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    np.random.set_state(
        (npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- save
def _has_state(obj: Any) -> bool:
    # Any object of the user's with state (an optimizer, a scheduler, a module, their own): duck-typed.
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _fsync_dir(directory: Path) -> None:
    # Make the rename itself durable (POSIX); not possible on every platform.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _atomic_save(payload: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException:
        # Any failure (including KeyboardInterrupt) leaves the old checkpoint as it was.
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def save_checkpoint(path: str | os.PathLike, *, rng: bool = True, **objects: Any) -> Path:
    """Atomically save ``objects`` (and the global RNG states) to ``path``.

    Each keyword is either an object with ``state_dict()``/``load_state_dict()`` (model, JEM,
    optimizer, LR scheduler, :class:`~jem_plugin.JEMLoss`, replay buffer, sampler, ...), a
    :class:`torch.Generator` (its state is saved), or a plain value (step counter, config
    dict, tensors) that :func:`load_checkpoint` hands back. Plain values must be tensors,
    numbers, strings, ``None`` or lists/tuples/dicts of those, since loading never unpickles
    anything else.

    ``rng=True`` also stores the global torch (CPU and CUDA), numpy and ``random`` states, so
    data noise, buffer reinitialisation and shuffling continue exactly after a resume.
    Returns the path written.
    """
    path = Path(path)
    states: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.Generator):
            states[name], kinds[name] = obj.get_state(), "generator"
        elif _has_state(obj):
            states[name], kinds[name] = obj.state_dict(), "state_dict"
        else:
            states[name], kinds[name] = obj, "value"
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "kinds": kinds,
        "objects": states,
        "rng": get_rng_state() if rng else None,
    }
    _atomic_save(payload, path)
    return path


# --------------------------------------------------------------------------- load
def _read(path: Path, map_location: Any) -> dict[str, Any]:
    if not path.exists():
        raise _error(MISSING, f"no checkpoint at {str(path)!r}")
    if path.is_dir():
        raise _error(
            MISSING,
            f"{str(path)!r} is a directory; pass the checkpoint file (Checkpointer(dir).latest() finds the newest one)",
        )
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only refuses any global it does not know: the file wants to build
        # arbitrary objects (which can run code). We never retry without weights_only.
        detail = _unpickling_detail(exc)
        if "global" in detail.lower():
            raise _error(
                UNSAFE,
                (
                    f"refused to load {str(path)!r}: it asks to build Python objects other than "
                    "tensors and plain containers, which could execute code when loaded "
                    f"({detail}). Only load checkpoints written by save_checkpoint."
                ),
            ) from None
        raise _error(
            CORRUPT,
            (
                f"cannot read checkpoint {str(path)!r}: it is corrupt or not a torch checkpoint "
                f"({detail}). Resume from an earlier checkpoint."
            ),
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError, UnicodeDecodeError) as exc:
        raise _error(
            CORRUPT,
            (
                f"cannot read checkpoint {str(path)!r}: the file is corrupt or truncated "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
                "Resume from an earlier checkpoint."
            ),
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise _error(
            CORRUPT,
            (
                f"{str(path)!r} is not a jem-plugin checkpoint (written by save_checkpoint). "
                "To load a bare model state_dict use model.load_state_dict(torch.load(path, "
                "weights_only=True))."
            ),
        )
    return payload


def _unpickling_detail(exc: BaseException) -> str:
    # torch's weights_only message is long; keep the line that says what was refused.
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        if "GLOBAL" in ln or "Unsupported" in ln or "unsupported" in ln:
            # not torch's advice to allowlist the class: that is what would let the file run code
            return ln.split(" Please use", 1)[0]
    return lines[-1] if lines else type(exc).__name__


def _lazy_slot(module: nn.Module, key: str) -> bool:
    """True when ``key`` belongs to a submodule slot that is still ``None`` (created on load, like
    the replay buffer of a JEMLoss built without one)."""
    obj: Any = module
    for part in key.split(".")[:-1]:
        child = getattr(obj, part, _MISSING)
        if child is None:
            return True
        if not isinstance(child, nn.Module):
            return False
        obj = child
    return False


_MISSING = object()


def _module_mismatches(module: nn.Module, state: dict[str, Any]) -> list[str]:
    """Human-readable differences between a module and a saved state_dict (first ones first)."""
    expected = module.state_dict()
    problems: list[str] = []
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected and not _lazy_slot(module, k)]
    if missing:
        problems.append(f"missing keys {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:5]}" + (" ..." if len(unexpected) > 5 else ""))
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs object {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state
        and isinstance(v, torch.Tensor)
        and isinstance(state[k], torch.Tensor)
        and v.shape != state[k].shape
    ]
    if shapes:
        problems.append("shape mismatch " + "; ".join(shapes[:5]) + (" ..." if len(shapes) > 5 else ""))
    return problems


def load_checkpoint(
    path: str | os.PathLike, *, rng: bool = True, map_location: Any = "cpu", strict: bool = True, **objects: Any
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``objects``.

    Every keyword names an object saved under the same name; its ``load_state_dict`` is called
    (a :class:`torch.Generator` gets its state set). Returns a dict with every stored entry
    that was not loaded into an object: plain values such as ``step``, and the state dicts of
    objects not passed here. ``rng=True`` restores the global RNG states if they were saved.

    Tensors are first loaded to ``map_location`` (CPU by default); ``load_state_dict`` then
    copies them to wherever each object lives. Modules are checked for missing/unexpected keys
    and shape mismatches before anything is loaded, so a mismatched model leaves every object
    untouched.

    Raises :class:`~jem_plugin.errors.CheckpointError` (with ``.reason`` one of ``"missing"``,
    ``"corrupt"``, ``"unsafe"``, ``"mismatch"``) for a missing, corrupt, truncated, unsafe
    or mismatched checkpoint.
    """
    path = Path(path)
    payload = _read(path, map_location)
    stored, kinds = payload["objects"], payload["kinds"]
    absent = [name for name in objects if name not in stored]
    if absent:
        raise _error(
            MISMATCH,
            (
                f"checkpoint {str(path)!r} has no entry {absent[0]!r}"
                + (f" (nor {absent[1:]})" if len(absent) > 1 else "")
                + f"; it holds {sorted(stored)}"
            ),
        )
    # Validate everything we can before touching anything.
    for name, obj in objects.items():
        kind = kinds.get(name)
        if isinstance(obj, torch.Generator):
            if kind != "generator":
                raise _error(MISMATCH, f"checkpoint entry {name!r} is a {kind}, not a torch.Generator state")
        elif _has_state(obj):
            if kind != "state_dict":
                raise _error(
                    MISMATCH,
                    f"checkpoint entry {name!r} is a {kind}, not a state_dict; "
                    f"cannot load it into {type(obj).__name__}",
                )
            if strict and isinstance(obj, nn.Module):
                target = obj
                if isinstance(obj, JEM) and stored[name] and not any(k.startswith("model.") for k in stored[name]):
                    target = obj.model  # a JEM given the bare model's state dict (JEM.load_state_dict allows it)
                problems = _module_mismatches(target, stored[name])
                if problems:
                    raise _error(
                        MISMATCH,
                        (
                            f"checkpoint {str(path)!r} does not match {name!r} "
                            f"({type(obj).__name__}): "
                            + "; ".join(problems)
                            + ". Was it saved from a different model or configuration?"
                        ),
                    )
        else:
            raise _error(
                MISMATCH,
                (
                    f"cannot restore {name!r}: {type(obj).__name__} has no load_state_dict(); plain "
                    "values are returned by load_checkpoint instead of being passed to it"
                ),
            )
    for name, obj in objects.items():
        try:
            if isinstance(obj, torch.Generator):
                obj.set_state(stored[name])
            elif isinstance(obj, nn.Module):
                obj.load_state_dict(stored[name], strict=strict)
            else:
                obj.load_state_dict(stored[name])
        except Exception as exc:  # optimizer group mismatch, buffer segments, ...
            raise _error(
                MISMATCH,
                (
                    f"checkpoint {str(path)!r} does not match {name!r} ({type(obj).__name__}): "
                    f"{type(exc).__name__}: {exc}"
                ),
            ) from exc
    if rng and payload.get("rng") is not None:
        set_rng_state(payload["rng"])
    return {name: value for name, value in stored.items() if name not in objects}


# --------------------------------------------------------------------------- Checkpointer
class Checkpointer:
    """Periodic checkpoints in one directory, keeping the newest ``keep``, and resume.

    >>> ckpt = Checkpointer("runs/digits", every=100, keep=2)
    >>> start = ckpt.resume(model=jm, optimizer=opt, loss=loss_fn).get("step", 0)  # {} if none
    >>> for step in range(start, total):
    ...     train_one_step()
    ...     ckpt.maybe_save(step + 1, model=jm, optimizer=opt, loss=loss_fn)

    Files are named ``{prefix}-{step:09d}.pt``; the step is also stored as ``step`` in the
    checkpoint. Only one process should write to a directory (rank 0 under DDP).
    """

    def __init__(self, directory: str | os.PathLike, every: int = 1000, keep: int = 2, prefix: str = "ckpt") -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
            raise ValueError(f"prefix must be a plain file-name part, got {prefix!r}")
        self.directory = Path(directory)
        self.every = every
        self.keep = keep
        self.prefix = prefix
        self._pattern = re.compile(rf"{re.escape(prefix)}-(\d+)\.pt")

    def path_for(self, step: int) -> Path:
        """The file a checkpoint of ``step`` is written to."""
        return self.directory / f"{self.prefix}-{step:09d}.pt"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every complete checkpoint, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = self._pattern.fullmatch(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest checkpoint file, or ``None``."""
        found = self.checkpoints()
        return found[-1][1] if found else None

    def save(self, step: int, **objects: Any) -> Path:
        """Save now (``step`` is stored too) and delete checkpoints beyond ``keep``."""
        path = save_checkpoint(self.path_for(step), step=step, **objects)
        # Older checkpoints beyond `keep`, and temp files of writes that were killed midway.
        for old in [p for _, p in self.checkpoints()[: -self.keep]] + self._stale_tmp_files():
            try:
                old.unlink()
            except OSError:
                pass
        return path

    def maybe_save(self, step: int, **objects: Any) -> Path | None:
        """Save when ``step`` is a multiple of ``every``; returns the path or ``None``."""
        if step % self.every == 0:
            return self.save(step, **objects)
        return None

    def resume(self, **objects: Any) -> dict[str, Any]:
        """Load the newest readable checkpoint into ``objects``; ``{}`` when there is none.

        A newest file that is unreadable (corrupt, truncated) is skipped with a warning and
        the previous one is used; a checkpoint that does not *match* the objects raises.
        """
        for _, path in reversed(self.checkpoints()):
            try:
                return load_checkpoint(path, **objects)
            except CheckpointError as exc:
                if exc.reason != CORRUPT:
                    raise
                warnings.warn(f"skipping unreadable checkpoint: {exc}", RuntimeWarning, stacklevel=2)
        return {}

    def _stale_tmp_files(self) -> list[Path]:
        # Single writer per directory: any temp file still here belongs to a dead write.
        if not self.directory.is_dir():
            return []
        return [
            p for p in self.directory.iterdir() if p.name.startswith(f".{self.prefix}-") and p.name.endswith(".tmp")
        ]
