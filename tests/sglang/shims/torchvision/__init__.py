"""Test-only placeholder for ``torchvision`` (see tests/sglang/__init__.py).

``sglang.srt.configs`` imports torchvision at module level, and PyPI's torchvision is
CUDA-linked and fails to load beside the CPU torch 2.13.0. Nothing on SGLang's text-model
CPU path calls into it, so any ``torchvision.X`` submodule is created empty on demand, and
any attribute is an inert placeholder; calling one raises, so a real use is loud.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+kvsidecar.placeholder"


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is a test placeholder (no torchvision here)")

    def __getattr__(self, attr: str) -> _Placeholder:
        return _Placeholder(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        mod = _Module(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
