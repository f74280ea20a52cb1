"""`specpilot memory list | search TEXT | show ID | export FILE | import FILE`: look into and move the memory.

Every subcommand takes --memory PATH (default $SPECPILOT_MEMORY, else ~/.local/share/specpilot/memory; a PATH ending
in .jsonl is a plain JSON-lines file, no Chroma) or --memory-url http://HOST:PORT, and --memory-fresh (move a
corrupted local store aside and start an empty one).
`add_memory_args` gives other commands (optimize) the same three flags.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..tools.argtypes import positive_int


def add_memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory", default=None, metavar="PATH",
                   help="memory store directory, or FILE.jsonl for a plain JSON-lines memory without Chroma "
                        "(default: $SPECPILOT_MEMORY or ~/.local/share/specpilot/memory)")
    p.add_argument("--memory-url", default=None, metavar="URL", help="a Chroma server instead: http://HOST:PORT")
    p.add_argument("--memory-fresh", action="store_true",
                   help="move the existing local store (directory or .jsonl file) aside (kept, never deleted) "
                        "and start an empty one")


def open_from_args(args):
    from . import open_memory

    memory = open_memory(args.memory, args.memory_url, args.memory_fresh)
    if getattr(memory, "moved_aside", None):
        print(f"specpilot: moved the previous memory store aside to {memory.moved_aside}", file=sys.stderr)
    return memory


def _summary(rid: str, o) -> str:
    from .records import failure_reason, worked

    d, c = o.deployment, o.candidate
    measured = (o.results or {}).get("speedup_vs_ar")
    gain = f" {measured:.2f}x" if isinstance(measured, (int, float)) else ""
    verdict = f"ok{gain}" if worked(o) else f"FAILED ({failure_reason(o)})"
    return (f"{rid}  {o.time}  {c.get('agent', '?')}  {d.get('target', '?')} on {d.get('device_name', '?')} "
            f"B={d.get('batch_size', '?')}  {verdict}  {c.get('reason', '')}")


def cmd_memory_list(args) -> int:
    with open_from_args(args) as memory:
        for rid, outcome in memory.records():
            print(_summary(rid, outcome))
    return 0


def cmd_memory_search(args) -> int:
    with open_from_args(args) as memory:
        hits = memory.search(args.text, args.k)
    if args.json:
        print(json.dumps([h.to_dict() for h in hits], default=str))
        return 0
    for h in hits:
        flags = f"  [{'; '.join(h.flags)}]" if h.flags else ""
        print(f"{h.score:8.3f}  {_summary(h.id, h.outcome)}{flags}")
    return 0


def cmd_memory_show(args) -> int:
    from ..engine.errors import SpecPilotError

    with open_from_args(args) as memory:
        try:
            outcome = memory.get(args.id)
        except KeyError as e:
            raise SpecPilotError(e.args[0]) from e
        flags = memory.flags(outcome)
    print(json.dumps({"id": args.id, "flags": flags, **outcome.to_dict()}, indent=2, default=str))
    return 0


def cmd_memory_export(args) -> int:
    with open_from_args(args) as memory:
        n = memory.export_jsonl(args.file)
        print(f"exported {n} records from {memory.location} to {args.file}")
    return 0


def cmd_memory_import(args) -> int:
    with open_from_args(args) as memory:
        n = memory.import_jsonl(args.file)
        print(f"imported {n} records from {args.file} into {memory.location}")
    return 0


def add_memory_parser(sub) -> None:
    m = sub.add_parser("memory", help="list, search, show, export and import the mechanism memory",
                       description="The mechanism memory (docs/MEMORY.md): every evaluated candidate with its "
                                   "deployment, measurements, gate verdict and library versions.")
    msub = m.add_subparsers(dest="memory_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    add_memory_args(common)
    p = msub.add_parser("list", parents=[common], help="every record, oldest first, one line each")
    p.set_defaults(func=cmd_memory_list)
    p = msub.add_parser("search", parents=[common], help="records whose mechanism matches TEXT, best first")
    p.add_argument("text", metavar="TEXT")
    p.add_argument("-k", type=positive_int, default=10, help="how many hits (default 10)")
    p.add_argument("--json", action="store_true", help="print the hits as one JSON list")
    p.set_defaults(func=cmd_memory_search)
    p = msub.add_parser("show", parents=[common], help="one record as JSON, with its flags")
    p.add_argument("id", metavar="ID")
    p.set_defaults(func=cmd_memory_show)
    p = msub.add_parser("export", parents=[common], help="write every record to a JSONL file (lossless)")
    p.add_argument("file", metavar="FILE")
    p.set_defaults(func=cmd_memory_export)
    p = msub.add_parser("import", parents=[common], help="add the records of an exported JSONL file")
    p.add_argument("file", metavar="FILE")
    p.set_defaults(func=cmd_memory_import)
