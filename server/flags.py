"""The flag and environment-variable machinery behind ``pagedserve serve``.

``server/config.py`` declares every setting once, as an ``Option`` in its table; this module
holds what turns that table into a parser: the value parsers (sizes, lists, booleans,
``none``/``auto``), the ``Option`` record (whose ``env`` name derives from its flag) and
``build_arg_parser``, which makes each variable's value the flag's default, so that
precedence is flag > ``PAGEDSERVE_*`` variable > the config's own default.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

ENV_PREFIX = "PAGEDSERVE_"

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """Parse a byte size such as ``1GiB``, ``512MB``, ``1.5g`` or ``1073741824``.

    Decimal units (KB, MB, GB) are powers of 1000 and binary units (KiB, MiB, GiB) powers of
    1024, as in ``ls --si`` vs ``ls -h``; a bare K/M/G is decimal.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 1GiB, 512MB, 1073741824)")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if value < 1 or not math.isfinite(value):
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return int(value)


def parse_list(text: str) -> tuple[str, ...]:
    """Split a comma-separated value (``a,b, c``) into its non-empty, stripped items."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off/(empty)``, in any case."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def parse_int_list(text: str) -> tuple[int, ...]:
    """``1,2,4,8`` -> (1, 2, 4, 8)."""
    try:
        return tuple(int(item) for item in parse_list(text))
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Accept ``none``/``auto`` as ``None`` (so an env var can restore a None default)."""

    def parse_optional(text: str) -> Any:
        return None if text.strip().lower() in ("none", "auto", "") else parse(text)

    parse_optional.__name__ = getattr(parse, "__name__", "value")
    return parse_optional


def parse_optional_name(text: str) -> str | None:
    """A name, or ``none``/``auto`` for None (the default's own name). Unlike ``optional``,
    an empty or blank value is a mistake, not None: a name clients must send cannot be
    empty (``--served-model-name ''``)."""
    if text.strip().lower() in ("none", "auto"):
        return None
    if not text.strip():
        raise ValueError(f"a name cannot be empty, got {text!r} (auto = the model's own name)")
    return text


# A boolean, or auto (none, empty) for None: the config decides (--async-scheduling). One
# object, so that the parser and --help can tell it from other optional values.
parse_bool_or_auto = optional(parse_bool)


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its flag, the config field it fills, and how its text is parsed."""

    flag: str
    group: str  # which config the value goes to: engine / kvpool / scheduler / server
    dest: str  # the field name in that config
    parse: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    # A "--no-x" switch: given alone it means true, and the config field gets the negation.
    negate: bool = False
    # A list: comma-separated, and a repeated flag adds to it (it replaces the env value).
    multiple: bool = False

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.lstrip("-").replace("-", "_").upper()


class _ExtendList(argparse.Action):
    """A list flag: each use adds its comma-separated items. The first use replaces the
    default (which may come from the environment), so flags still win over env vars."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest)
        if current is self.default:
            current = ()
        setattr(namespace, self.dest, (*current, *values))


def _is_bool(option: Option) -> bool:
    return option.parse in (parse_bool, parse_bool_or_auto)


def _shown_default(option: Option) -> str:
    if option.default is None and option.parse is parse_bool_or_auto:
        return "'auto'"
    return repr(option.default)


def _metavar(option: Option) -> str:
    """How ``--help`` shows the value: BOOL for switches and booleans (never the last word
    of the field, "--no-prefix-caching [CACHING]"), BOOL|auto where auto lets the config
    decide, else the field's last word."""
    if option.parse is parse_bool_or_auto:
        return "BOOL|auto"
    if option.negate or option.parse is parse_bool:
        return "BOOL"
    return option.dest.split("_")[-1].upper()


class _OneLineParser(argparse.ArgumentParser):
    """A mistake on the command line is one line naming it, not argparse's usage block (the
    serve command's usage runs to some fifty lines, above the line that matters)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments"):
            message += f" ({self.prog} --help lists the flags)"
        self.exit(2, f"{self.prog}: error: {message}\n")


def _says_why(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ValueError's own message shown: argparse turns a ValueError into
    "invalid <function name> value", dropping what our parsers say (the accepted forms)."""
    if parse in (int, float, str):  # argparse's "invalid int value: 'x'" says it
        return parse
    name = getattr(parse, "__name__", "")

    def parse_saying_why(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            if name in ("int", "float"):  # optional(int): not Python's "invalid literal for"
                raise argparse.ArgumentTypeError(f"invalid {name} value: {text!r}") from None
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_saying_why


def build_arg_parser(
    options: Sequence[Option], environ: Mapping[str, str]
) -> argparse.ArgumentParser:
    """The `pagedserve serve` parser over ``options``; env values become the defaults, so
    flags win."""
    parser = _OneLineParser(
        prog="pagedserve serve",
        description="Serve a model over an OpenAI-compatible HTTP API. Every flag can also be "
        f"set with an environment variable {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT=8001); "
        "a flag wins over the variable.",
    )
    for option in options:
        default = option.default
        raw = environ.get(option.env)
        if raw is not None:
            try:
                default = option.parse(raw)
            except ValueError as exc:
                parser.error(f"{option.env}={raw!r}: {exc}")
            if option.choices is not None and default not in (*option.choices, None):
                parser.error(f"{option.env}={raw!r}: choose from {', '.join(option.choices)}")
        if option.multiple:
            parser.add_argument(
                option.flag,
                dest=option.dest,
                type=_says_why(option.parse),
                default=default,
                action=_ExtendList,
                metavar=option.dest.split("_")[-1].upper(),
                help=f"{option.help} [env {option.env}; default {','.join(option.default)!r}]",
            )
            continue
        parser.add_argument(
            option.flag,
            dest=option.dest,
            type=_says_why(option.parse),
            default=default,
            choices=option.choices,
            metavar=None if option.choices else _metavar(option),
            help=f"{option.help} [env {option.env}; default {_shown_default(option)}]",
            # A boolean given alone means true (--enforce-eager), as argparse switches do.
            nargs="?" if option.negate or _is_bool(option) else None,
            const=True if option.negate or _is_bool(option) else None,
        )
    return parser
