"""`epic-rag store stats|ls|verify|clear --store SPEC`: look into (or empty) a chunk KV store."""

from __future__ import annotations

import argparse
import json
import sys

from .base import ChunkStore


def _tiers(store: ChunkStore) -> list[ChunkStore]:
    return list(getattr(store, "tiers", [store]))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def _open(args: argparse.Namespace) -> ChunkStore:
    from . import open_store

    return open_store(args.store)


def cmd_stats(args: argparse.Namespace) -> int:
    with _open(args) as store:
        store.refresh()
        stats = store.tier_stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    for name, s in stats.items():
        state = "" if s["available"] else "  (unreachable)"
        print(f"{name}: {s['entries']} entries, {_human(s['bytes'])}{state}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with _open(args) as store:
        for tier in _tiers(store):
            for key, size in sorted(tier.usage().items()):
                print(f"{tier.name}\t{key}\t{size}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    bad_total = 0
    with _open(args) as store:
        for tier in _tiers(store):
            keys = tier.keys()
            ok = sum(tier.verify(k) for k in keys)
            bad = tier.stats.corrupt
            bad_total += bad
            print(f"{tier.name}: {len(keys)} checked, {ok} ok, {bad} corrupt (dropped)")
    return 1 if bad_total else 0


def cmd_clear(args: argparse.Namespace) -> int:
    with _open(args) as store:
        for tier in _tiers(store):
            print(f"{tier.name}: {tier.clear()} entries deleted")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("store", help="inspect, verify or clear a chunk KV store", description=__doc__)
    sub = p.add_subparsers(dest="store_cmd", required=True)
    for name, fn, text in (
        ("stats", cmd_stats, "entries and bytes per tier"),
        ("ls", cmd_ls, "list entries: tier, key, stored bytes"),
        ("verify", cmd_verify, "read every entry and check it (corrupt ones are deleted); exit 1 if any"),
        ("clear", cmd_clear, "delete every entry (only this store's keys/files)"),
    ):
        q = sub.add_parser(name, help=text, description=text)
        q.add_argument(
            "--store",
            required=True,
            help="store spec, e.g. disk:/var/cache/epic-rag or redis://127.0.0.1:6379/0 "
            "(see epic_rag.store.open_store)",
        )
        if name == "stats":
            q.add_argument("--json", action="store_true", help="all counters as JSON")
        q.set_defaults(func=fn)


if __name__ == "__main__":  # python -m epic_rag.store.cli stats --store ...
    parser = argparse.ArgumentParser(prog="epic-rag")
    register(parser.add_subparsers(dest="cmd", required=True))
    ns = parser.parse_args(["store", *sys.argv[1:]])
    sys.exit(ns.func(ns))
