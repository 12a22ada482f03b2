"""``python -m kvtestbed.docs [--check] | bench NAME``: regenerate the site's generated parts,
list the stale ones (exit 1), or record a benchmark run for its page."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path.cwd()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtestbed.docs", description=__doc__)
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 listing every stale generated page")
    p.add_argument("--root", type=Path, default=ROOT, help="the repository (default: .)")
    sub = p.add_subparsers(dest="cmd")
    b = sub.add_parser("bench", help="re-run a recorded benchmark and store its JSON")
    from kvtestbed.docs.bench_record import BENCHES, record

    b.add_argument("name", choices=sorted(BENCHES))
    args = p.parse_args(argv)
    root = args.root.resolve()
    if args.cmd == "bench":
        code = record(args.name, root)
        if code == 2:
            return 2
    from kvtestbed.docs.page_list import orphans, outputs

    if args.check:
        stale = [o.path for o in outputs(root) if o.is_stale(root)] + orphans(root)
        for path in stale:
            print(f"stale: {path}")
        if stale:
            print("run `python -m kvtestbed.docs` and commit the result", file=sys.stderr)
        return 1 if stale else 0
    for o in outputs(root):
        if o.write(root):
            print(f"wrote {o.path}")
    for path in orphans(root):
        (root / path).unlink()
        print(f"removed {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
