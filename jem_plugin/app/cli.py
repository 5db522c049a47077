"""The ``jem`` command: demo, train, eval, ood, sample, plugins, doctor.

Every subcommand takes ``--device``, ``--seed``, ``--out`` and ``--config FILE`` (JSON or TOML
whose keys are option names, e.g. ``{"epochs": 5, "sgld_steps": 10}``; flags on the command line
win). User errors (bad flags, missing paths, incompatible checkpoints) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from .. import __version__
from ..errors import JEMError, UnknownNameError, UntrainedDensityWarning
from . import CLIError
from .commands import demo, doctor, evaluate, ood, plugins, sample, train
from .commands._common import DEFAULT_DEVICE, _positive
from .model_files import notes_once

# In the order of `jem --help`.
COMMANDS = (demo, train, evaluate, ood, sample, plugins, doctor)


# ----------------------------------------------------------------------------- helpers
def _load_config(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"config file {path!r} does not exist")
    text = p.read_text()
    if p.suffix == ".toml":
        try:
            import tomllib
        except ImportError as exc:  # Python 3.10
            raise CLIError("TOML configs need Python >= 3.11; use a JSON config") from exc
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise CLIError(f"config file {path!r} is not valid TOML: {exc}") from exc
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CLIError(f"config file {path!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CLIError(f"config file {path!r} must hold a table/object of option names")
    return {k.replace("-", "_"): v for k, v in data.items()}


def _check_config_types(config: dict[str, Any], actions: dict[str, argparse.Action], path: str) -> None:
    """A config value of the wrong type names the file and the key, not just argparse's complaint."""
    for key, value in config.items():
        a = actions[key]
        want: Any = bool if a.nargs == 0 else (int if a.type is _positive else a.type) or str
        ok = (
            isinstance(value, bool)
            if want is bool
            else (
                value is None
                or (
                    not isinstance(value, bool)
                    and (
                        isinstance(value, int)
                        if want is int
                        else isinstance(value, (int, float))
                        if want is float
                        else isinstance(value, str)
                    )
                )
            )
        )
        if not ok:
            name = getattr(want, "__name__", "text")
            raise CLIError(f"config file {path!r}: {key} = {value!r} is not {name}; write it as a JSON/TOML {name}")
        if a.choices is not None and value not in a.choices:
            raise CLIError(f"config file {path!r}: {key} = {value!r}; choose one of {', '.join(map(str, a.choices))}")


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (``(default: X)``) unless it states one itself;
    options whose default is decided at run time (None) say so in their own words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or "default" in text
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or text == argparse.SUPPRESS
        ):
            return action.help
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as the one-line ``jem: error: ...`` of every other user error, and
    every option's default in its help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise CLIError(f"{message} (see `{self.prog} --help`)")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's own check (a private hook, stable since 3.2), with the nearest choice named
        # as every other unknown name is: `jem trian`, `--recipe fats`
        if action.choices is not None and value not in action.choices:
            names = [str(c) for c in action.choices]
            raise argparse.ArgumentError(
                action,
                f"invalid choice: {value!r}{UnknownNameError.did_you_mean(str(value), names)} "
                f"(choose from {', '.join(names)})",
            )


def warning_line(message: Warning | str, category: type[Warning]) -> str:
    """A warning as the one ``jem: warning:`` line a command prints: its text on one line, without
    Python's file, line and source (``bin/jem:8``, ``sys.exit(main())``); the library's warning
    for a JEM score on an untrained model in the CLI's own words, without its list of every other
    score."""
    text = " ".join(str(message).split())
    if issubclass(category, UntrainedDensityWarning):
        found = re.search(r"OOD score '([^']+)'", text)
        name = found.group(1) if found else "this"
        return (
            f"jem: warning: the OOD score {name} assumes a JEM-trained model, and this model's log p(x) was not "
            "trained (a cross-entropy classifier): it can rank OOD inputs above in-distribution ones; leave it "
            "out of --scores (e.g. --scores logpx,msp), or score a model from jem train"
        )
    return f"jem: warning: {text}"


@contextmanager
def warnings_as_lines() -> Iterator[None]:
    """Within it (one ``jem`` command), every warning shown is one :func:`warning_line` on stderr."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(warning_line(message, category), file=sys.stderr, flush=True)

    before = warnings.showwarning
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = before


# ----------------------------------------------------------------------------- parser
OUT_HELP = (
    "output path (default: train runs/jem, demo jem-report, eval stdout only, ood and sample next to the checkpoint)"
)


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--device", default=DEFAULT_DEVICE, help="torch device: cpu, cuda, cuda:1, mps")
    common.add_argument("--seed", type=int, default=0, help="random seed")
    common.add_argument("--out", default=None, help=OUT_HELP)
    common.add_argument(
        "--config", default=None, help="JSON or TOML file of option defaults; flags given here win (default: none)"
    )
    common.add_argument("--quiet", action="store_true", help="no progress bars")

    parser = _Parser(prog="jem", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s (jem-plugin) {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub, common)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        # Config values become defaults; flags given on the command line still win.
        config = _load_config(args.config)
        # argparse keeps a parser's actions private: read them to know the command's options.
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subparser = commands.choices[args.command]
        known = {a.dest for a in subparser._actions}
        unknown = sorted(set(config) - known)
        if unknown:
            raise CLIError(
                f"config file {args.config!r} has unknown options for `jem {args.command}`: {', '.join(unknown)}"
            )
        _check_config_types(config, {a.dest: a for a in subparser._actions}, args.config)
        subparser.set_defaults(**config)
        args = parser.parse_args(argv)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args: argparse.Namespace | None = None
    try:
        args = parse_args(argv)
        with notes_once(), warnings_as_lines():
            return args.func(args)
    except (JEMError, FileNotFoundError, ValueError) as exc:
        print(f"jem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # A command that leaves something to continue from says how (jem train: its checkpoints).
        hint = getattr(args, "interrupted", None)
        print(f"jem: interrupted; {hint(args)}" if hint else "jem: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `jem eval ... | head`: the reader left; stop quietly, and keep Python's exit-time flush of
        # stdout from raising the same error again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
