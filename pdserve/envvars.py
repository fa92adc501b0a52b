"""Every flag of a command line also read from an environment variable.

``--kv-cache-gib`` is ``PDSERVE_KV_CACHE_GIB``: the prefix, then the flag's long name in
upper snake case. A flag given on the command line wins over its variable; repeatable flags
(``--prefill``) and flags taking several values take a comma-separated list; on/off flags
take 1/true/yes/on or 0/false/no/off. `parse_args` works on any argparse parser after it
is built, walking its actions (and its subcommands'), so no flag is declared twice.

Variables are converted only for the subcommand that runs: an operator's environment
may hold ``PDSERVE_KV_TRANSPORT=shm,tcp`` for the workers, which `up` (one transport)
would refuse, and `pdserve generate` must not fail over it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

PREFIX = "PDSERVE_"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")

# Actions that carry no value of their own.
_SKIPPED = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


@dataclass(frozen=True)
class _FromEnv:
    """An action's default while its variable is set; replaced by the converted value
    after parsing, unless the flag was given (then argparse stored the flag's value)."""

    var: str
    raw: str

    def __copy__(self) -> list:
        # argparse copies a repeatable flag's default before appending to it: an explicit
        # --prefill then starts from an empty list, not from the variable's addresses.
        return []

    def __str__(self) -> str:  # what --help shows as the default
        return f"${self.var}={self.raw}"


def env_var(action: argparse.Action) -> str | None:
    """The variable an optional action reads (None for positionals and help)."""
    if isinstance(action, _SKIPPED) or not action.option_strings or action.help == argparse.SUPPRESS:
        return None
    long_names = [s for s in action.option_strings if s.startswith("--")]
    if not long_names:
        return None
    return PREFIX + long_names[0][2:].upper().replace("-", "_")


def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser below it, each once."""
    seen: set[int] = set()
    stack = [parser]
    while stack:
        p = stack.pop()
        if id(p) in seen:
            continue  # aliases map several names to one parser
        seen.add(id(p))
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())


def document(parser: argparse.ArgumentParser) -> None:
    """Names each flag's variable in its --help line (once, however often called)."""
    for p in parsers(parser):
        for action in p._actions:
            var = env_var(action)
            if var is not None and var not in (action.help or ""):
                action.help = f"{action.help} [env: {var}]" if action.help else f"[env: {var}]"


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
               environ: Mapping[str, str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with each flag not given taken from ``environ`` where
    its variable is set. A bad value exits (status 2) with a message naming the variable."""
    document(parser)
    originals: dict[int, tuple[object, bool]] = {}
    for p in parsers(parser):
        for action in p._actions:
            var = env_var(action)
            if var is not None and var in environ:
                originals[id(action)] = (action.default, action.required)
                action.default = _FromEnv(var, environ[var])
                action.required = False  # the variable satisfies it
    try:
        args = parser.parse_args(argv)
        for p in _chosen(parser, args):
            for action in p._actions:
                value = getattr(args, action.dest, None)
                if isinstance(value, _FromEnv) and id(action) in originals:
                    setattr(args, action.dest, _convert(p, action, value, originals[id(action)][0]))
        return args
    finally:
        for p in parsers(parser):
            for action in p._actions:
                if id(action) in originals:
                    action.default, action.required = originals[id(action)]


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Iterator[argparse.ArgumentParser]:
    """The parsers the command line went through: the top one, its subcommand's, ..."""
    p: argparse.ArgumentParser | None = parser
    while p is not None:
        yield p
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        p = subs[0].choices.get(name) if name is not None else None


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, env: _FromEnv, default: object) -> object:
    """The variable's text as the flag's value, as argparse would have stored it."""
    if action.nargs == 0:  # on/off flags: store_true, store_false, store_const, count
        on = _boolean(parser, env)
        if isinstance(action, argparse._CountAction):
            return 1 if on else default
        return action.const if on else default
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+") or isinstance(action.nargs, int)
    items = [part.strip() for part in env.raw.split(",") if part.strip()] if many else [env.raw]
    values = [_convert_one(parser, action, env, item) for item in items]
    if not many:
        return values[0]
    if action.nargs == "+" and not values or isinstance(action.nargs, int) and len(values) != action.nargs:
        want = "at least one value" if action.nargs == "+" else f"{action.nargs} values"
        parser.error(f"{env.var}={env.raw!r}: want {want}, comma-separated")
    return values


def _convert_one(parser: argparse.ArgumentParser, action: argparse.Action, env: _FromEnv, text: str) -> object:
    try:
        value = action.type(text) if action.type is not None else text
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        kind = getattr(action.type, "__name__", "value")
        detail = str(e) if isinstance(e, argparse.ArgumentTypeError) else f"not a valid {kind}"
        parser.error(f"{env.var}={env.raw!r} (for {action.option_strings[0]}): {detail}")
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        parser.error(f"{env.var}={env.raw!r} (for {action.option_strings[0]}): choose from {choices}")
    return value


def _boolean(parser: argparse.ArgumentParser, env: _FromEnv) -> bool:
    word = env.raw.strip().lower()
    if word not in TRUE_WORDS + FALSE_WORDS:
        parser.error(f"{env.var}={env.raw!r}: want one of {', '.join(TRUE_WORDS)} "
                     f"or {', '.join(FALSE_WORDS[:-1])}")
    return word in TRUE_WORDS


def command_vars(parser: argparse.ArgumentParser, args: argparse.Namespace) -> set[str]:
    """Every variable a flag of the command that ``args`` came from reads."""
    return {var for p in _chosen(parser, args) for var in map(env_var, p._actions) if var is not None}
