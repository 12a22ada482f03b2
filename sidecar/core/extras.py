"""Optional features and the ``pip`` extra each needs, checked before the feature imports.

``pip install kv-sidecar`` is the lean runtime (torch, prometheus-client, opentelemetry-sdk,
apscheduler): what the sidecar needs beside an engine. The reference engine, its faults, the
demo and the benchmarks need transformers (``[demo]``); the vLLM adapter's event stream and
probe transport need pyzmq/msgpack (``[events]``); the vLLM adapter's HF reference needs
transformers (``[hf]``). A command whose extra is missing must say which one to install
(exit code 2), not die in an ``ImportError`` traceback.
"""

from __future__ import annotations

import importlib.util


class MissingExtra(Exception):
    """A feature's optional dependencies are not installed; the message names the extra."""


# feature -> (extra, the top-level modules it imports)
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "demo": ("demo", ("transformers",)),
    "faults": ("demo", ("transformers",)),
    "bench": ("demo", ("transformers",)),
    "vllm": ("events", ("zmq", "msgpack")),
    "hf-reference": ("hf", ("transformers",)),
    "otlp": ("otlp", ("opentelemetry.exporter.otlp.proto.http",)),
    "otlp-grpc": ("otlp-grpc", ("opentelemetry.exporter.otlp.proto.grpc", "grpc")),
    "plot": ("plot", ("matplotlib",)),  # kv-sidecar evidence show --plot
}


def missing_modules(modules: tuple[str, ...]) -> list[str]:
    """Which of ``modules`` cannot be imported here (found without importing them)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(feature: str) -> None:
    """Raise :class:`MissingExtra` when ``feature``'s extra is not installed."""
    extra, modules = EXTRAS[feature]
    missing = missing_modules(modules)
    if missing:
        raise MissingExtra(
            f"`{feature}` needs {', '.join(missing)}, which the lean runtime does not "
            f"install: pip install 'kv-sidecar[{extra}]' (from a checkout: "
            f"pip install -e '.[{extra}]')")
