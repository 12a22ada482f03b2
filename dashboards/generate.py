"""Write (or check) the committed JSON of every ``dashboards/*.dashboard.py``.

    python -m dashboards.generate          # rewrite dashboards/<name>.json
    python -m dashboards.generate --check  # exit 1 when a committed JSON is stale

Each source follows grafanalib's convention (a module-level ``dashboard``); the JSON is
committed so Grafana users can import it without Python, and the check keeps it from
drifting away from the source and from ``sidecar/signals/``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SUFFIX = ".dashboard.py"


def sources() -> list[Path]:
    return sorted(HERE.glob(f"*{SUFFIX}"))


def json_path(source: Path) -> Path:
    return source.with_name(source.name[: -len(SUFFIX)] + ".json")


def load(source: Path) -> Any:
    """Execute a ``*.dashboard.py`` (not importable by name: it has a dot) and return its
    ``dashboard``."""
    name = f"dashboards._src_{source.name[: -len(SUFFIX)]}"
    spec = importlib.util.spec_from_file_location(name, source)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {source}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dashboard = getattr(module, "dashboard", None)
    if dashboard is None:
        raise AttributeError(f"{source} defines no `dashboard`")
    return dashboard


class _Encoder(json.JSONEncoder):
    """grafanalib objects serialise themselves through ``to_json_data``."""

    def default(self, o: Any) -> Any:
        to_json = getattr(o, "to_json_data", None)
        return to_json() if callable(to_json) else super().default(o)


def render(source: Path) -> str:
    data = load(source).to_json_data()
    return json.dumps(data, sort_keys=True, indent=2, cls=_Encoder) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="fail when a committed JSON differs from its source")
    args = parser.parse_args(argv)
    stale = []
    for source in sources():
        text, target = render(source), json_path(source)
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(target)
        else:
            target.write_text(text)
    for target in stale:
        print(f"{target} is stale: run `python -m dashboards.generate`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
