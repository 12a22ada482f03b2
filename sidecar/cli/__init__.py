"""The ``kv-sidecar`` command line (:mod:`sidecar.cli.main`); ``main`` is the entry point."""

from sidecar.cli.main import main

__all__ = ["main"]
