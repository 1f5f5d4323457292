"""`metainfer` command line: one subcommand per tool.

Each tool module exposes `register(subparsers)`, which adds its parser and sets `func(args) -> int`.
Modules are imported only for the chosen subcommand's registration, and they keep heavy imports
(torch, transformers, fastapi) inside their `func`, so `metainfer --help` stays fast.
"""

from __future__ import annotations

import argparse
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
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="metainfer", description="MetaInfer: VibeQwen engine, oracle, bench"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
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
