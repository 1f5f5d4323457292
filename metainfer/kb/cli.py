"""`metainfer kb list|show|add|check`: query and extend the knowledge base."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

DIR_HELP = "records folder (default: the shipped records)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kb", help="the knowledge base of verified optimisations")
    kb = p.add_subparsers(dest="kb_command", metavar="ACTION")
    ls = kb.add_parser("list", help="one line per record")
    ls.add_argument(
        "--status", choices=["kept", "reverted", "superseded", "proposed"], help="only these (default: all)"
    )
    ls.add_argument("--precision", choices=["bfloat16", "fp8"], help="only these (default: all)")
    ls.add_argument("--grep", help="substring anywhere in the record (default: none)")
    ls.add_argument("--dir", type=Path, default=None, help=DIR_HELP)
    ls.set_defaults(func=_list)
    sh = kb.add_parser("show", help="a record in full")
    sh.add_argument("id")
    sh.add_argument("--dir", type=Path, default=None, help=DIR_HELP)
    sh.set_defaults(func=_show)
    add = kb.add_parser("add", help="add a record from a JSON file (id and date are filled in if absent)")
    add.add_argument("file", help="JSON record, or - for stdin")
    add.add_argument("--dir", type=Path, default=None, help=DIR_HELP)
    add.set_defaults(func=_add)
    ck = kb.add_parser("check", help="validate every record")
    ck.add_argument("--dir", type=Path, default=None, help=DIR_HELP)
    ck.set_defaults(func=_check)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _dir(args):
    from metainfer.kb.records import RECORDS_DIR

    return args.dir or RECORDS_DIR


def _list(args) -> int:
    from metainfer.kb.records import load_all, query

    for r in query(load_all(_dir(args)), args.status, args.grep, args.precision):
        after = ", ".join(f"{k}={v}" for k, v in list(r.after.items())[:3])
        verdict = {True: "oracle pass", False: "oracle FAIL", None: "no verdict"}[r.oracle.get("passed")]
        print(f"{r.id}  {r.status:<10} {r.target.precision:<8} {r.title}  [{after}; {verdict}]")
    return 0


def _show(args) -> int:
    from metainfer.kb.records import load_all

    for r in load_all(_dir(args)):
        if r.id == args.id:
            print(json.dumps(r.to_dict(), indent=2))
            return 0
    print(f"no record {args.id}", file=sys.stderr)
    return 1


def _add(args) -> int:
    from metainfer.kb.records import Record, next_id, save

    raw = json.loads(sys.stdin.read() if args.file == "-" else Path(args.file).read_text())
    raw.setdefault("id", next_id(_dir(args)))
    raw.setdefault("date", date.today().isoformat())
    try:
        rec = Record.from_dict(raw)
    except (ValueError, TypeError) as e:
        print(f"invalid record: {e}", file=sys.stderr)
        return 2
    print(save(rec, _dir(args)))
    return 0


def _check(args) -> int:
    from metainfer.kb.records import load_all

    try:
        recs = load_all(_dir(args))
    except ValueError as e:
        print(f"invalid: {e}", file=sys.stderr)
        return 1
    print(f"{len(recs)} records ok")
    return 0
