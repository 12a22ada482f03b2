"""``python -m sidecar.adapters.vllm.probe_install DIR``: put the probe where vLLM can import it.

In a Kubernetes pod (deploy/kubernetes) vLLM runs from its own, unmodified image, and the
probe (``sidecar.adapters.vllm.probe``, loaded by module path) must be importable in *that*
Python. An init container running the kv-sidecar image calls this to copy the ``sidecar``
package and ``msgpack`` (the one thing the probe imports that vLLM does not require) into a
shared volume; the vLLM container puts the volume on ``PYTHONPATH``. ``msgpack``'s compiled
extension only loads in a matching Python; otherwise msgpack falls back to its pure-Python
packer, which is enough for the probe (it packs sampled hits only). Compiled caches are not
copied, and an existing copy is replaced as a whole, so a restarted pod never mixes versions.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from types import ModuleType

_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def _package_dir(module: ModuleType) -> Path:
    if module.__file__ is None:
        raise RuntimeError(f"{module.__name__} has no files to copy")
    return Path(module.__file__).resolve().parent


def install(dest: Path) -> list[Path]:
    """Copy ``sidecar`` and ``msgpack`` into ``dest``; returns the copied package dirs."""
    import msgpack

    import sidecar

    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for module in (sidecar, msgpack):
        target = dest / module.__name__
        staging = dest / f".{module.__name__}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(_package_dir(module), staging, ignore=_IGNORE)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        copied.append(target)
    return copied


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sidecar.adapters.vllm.probe_install",
                                description=__doc__.splitlines()[0])
    p.add_argument("dest", type=Path, help="directory vLLM's container puts on PYTHONPATH")
    a = p.parse_args(argv)
    try:
        copied = install(a.dest)
    except (OSError, ImportError, RuntimeError) as exc:
        print(f"probe_install: error: cannot install into {a.dest}: {exc}", file=sys.stderr)
        return 1
    for path in copied:
        print(f"probe_install: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
