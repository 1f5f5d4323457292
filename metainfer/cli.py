"""`metainfer` command line: one subcommand per tool.

Each tool module exposes `register(subparsers)`, which adds its parser and sets `func(args) -> int`.
Modules are imported only for the chosen subcommand's registration, and they keep heavy imports
(torch, transformers, fastapi) inside their `func`, so `metainfer --help` stays fast.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys

# subcommand -> module that registers it
COMMANDS: dict[str, str] = {
    "generate": "metainfer.generate_cli",
    "serve": "metainfer.server.cli",
    "verify": "metainfer.oracle.cli",
    "bench": "metainfer.bench.cli",
    "kb": "metainfer.kb.cli",
    "tune": "metainfer.loop.cli",
    "loop": "metainfer.loop.cli",
    "sam": "metainfer.sam.cli",
}


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it in words (a default
    of None means something the help must state). Flags are off unless given."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.nargs == 0
            or action.default in (None, argparse.SUPPRESS)
            or "default" in text.lower()
        ):
            return text
        if action.default == []:  # a repeatable option given no times
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"

    def _format_usage(self, usage, actions, groups, prefix) -> str:  # type: ignore[no-untyped-def]
        if usage is None and sum(1 for a in actions if a.option_strings) > 8:  # options: in the help below
            positionals = [a for a in actions if not a.option_strings]
            usage = f"%(prog)s [OPTIONS] {self._format_actions_usage(positionals, groups)}".rstrip()
        return super()._format_usage(usage, actions, groups, prefix)

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.help is not argparse.SUPPRESS:  # argparse prints nothing for it
            action = copy.copy(action)
            action.help = self._get_help_string(action)
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    """Every `metainfer` parser and subparser: option defaults shown in `--help`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog="metainfer", description="MetaInfer: VibeQwen engine, oracle, bench")
    # subparsers (and theirs: argparse reuses the parent's class) are `Parser`s
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    registered: set[str] = set()
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            continue
        if module in registered:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("metainfer"):
                continue  # tool not built yet
            raise
        mod.register(sub)
        registered.add(module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first if first in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
