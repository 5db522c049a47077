"""Step-size schedules for SGLD: small frozen values, one per shape of decay.

``SGLD(step_size=1.0)`` keeps a constant step; ``SGLD(step_size=Poly(1.0, end=0.01))`` decays it.
A schedule is called as ``schedule(t, steps)`` for ``t = 0 .. steps - 1`` and returns ``a_t``;
any callable of that form works (a plain ``t -> a_t`` function too, see :func:`as_schedule`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

__all__ = ["Schedule", "Constant", "Poly", "as_schedule", "schedule_to_dict", "schedule_from_dict"]


@runtime_checkable
class Schedule(Protocol):
    """What SGLD calls for the step size of step ``t`` of a chain of ``steps`` steps."""

    def __call__(self, t: int, steps: int) -> float: ...


def _positive(name: str, value: Any) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}") from None
    if not (math.isfinite(f) and f > 0):
        raise ValueError(f"{name} must be > 0 and finite, got {value!r}")
    return f


@dataclass(frozen=True)
class Constant:
    """``a_t = value`` for every step."""

    value: float
    kind: ClassVar[str] = "constant"

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", _positive("Constant value", self.value))

    def __call__(self, t: int, steps: int) -> float:
        return self.value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"

    def scaled(self, factor: float) -> Constant:
        """This schedule with every step size multiplied by ``factor``."""
        return Constant(self.value * factor)


@dataclass(frozen=True)
class Poly:
    """The polynomial decay of Welling & Teh (2011): ``a_t = start * (1 + t / b) ** -power``.

    ``b = 1`` unless ``end`` is given; then ``b`` is chosen so that the last step of the chain
    uses exactly ``end`` (``a_0 = start`` always). Welling & Teh recommend ``power`` in ``(0.5, 1]``.
    """

    start: float
    power: float = 0.55
    end: float | None = None
    kind: ClassVar[str] = "poly"

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", _positive("Poly start", self.start))
        object.__setattr__(self, "power", _positive("Poly power", self.power))
        if self.end is not None:
            end = _positive("Poly end", self.end)
            if end > self.start:
                raise ValueError(f"Poly end ({end}) must not exceed start ({self.start}): the schedule decays")
            object.__setattr__(self, "end", end)

    def __call__(self, t: int, steps: int) -> float:
        b = 1.0
        if self.end is not None and steps > 1:
            ratio = (self.start / self.end) ** (1.0 / self.power) - 1.0
            b = (steps - 1) / ratio if ratio > 0 else math.inf
        return self.start * (1.0 + t / b) ** -self.power

    def __repr__(self) -> str:
        end = "" if self.end is None else f", end={self.end!r}"
        return f"Poly({self.start!r}, power={self.power!r}{end})"

    def scaled(self, factor: float) -> Poly:
        """This schedule with every step size multiplied by ``factor`` (the same decay)."""
        return Poly(self.start * factor, self.power, None if self.end is None else self.end * factor)


SCHEDULE_KINDS: dict[str, type[Constant] | type[Poly]] = {c.kind: c for c in (Constant, Poly)}


def schedule_to_dict(schedule: Constant | Poly) -> dict[str, Any]:
    """``schedule`` as plain data (``{"kind": "poly", "start": 1.0, "power": 0.55, "end": 0.01}``),
    loadable from a ``weights_only`` checkpoint."""
    return {"kind": schedule.kind, **{f.name: getattr(schedule, f.name) for f in dataclasses.fields(schedule)}}


def schedule_from_dict(data: Mapping[str, Any]) -> Constant | Poly:
    """The schedule :func:`schedule_to_dict` wrote."""
    data = dict(data)
    kind = data.pop("kind", None)
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"unknown step-size schedule kind {kind!r}; known: {tuple(SCHEDULE_KINDS)}")
    return SCHEDULE_KINDS[kind](**data)


class _PerStep:
    """A user's ``t -> a_t`` function as a :class:`Schedule`."""

    def __init__(self, fn: Callable[[int], float]) -> None:
        self.fn = fn

    def __call__(self, t: int, steps: int) -> float:
        return float(self.fn(t))

    def __repr__(self) -> str:
        return getattr(self.fn, "__qualname__", "callable")


def as_schedule(step_size: float | Callable[..., float]) -> Schedule:
    """``step_size`` as a :class:`Schedule`: a number becomes :class:`Constant`, a one-argument
    function ``t -> a_t`` is called with ``t`` only, a schedule is returned as it is."""
    if not callable(step_size):
        return Constant(step_size)
    if isinstance(step_size, (Constant, Poly)):
        return step_size
    try:
        takes_steps = len(inspect.signature(step_size).parameters) >= 2
    except (TypeError, ValueError):  # a builtin without a signature: called as t -> a_t
        takes_steps = False
    return step_size if takes_steps else _PerStep(step_size)
