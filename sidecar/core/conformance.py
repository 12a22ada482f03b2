"""Does an object really implement a protocol? Names *and* signatures, not just names.

``isinstance(x, Adapter)`` on a ``runtime_checkable`` protocol only checks that each method
name exists: an adapter whose ``read(self)`` forgot ``refs`` passes, and the first sampled
hit fails deep in the verifier thread as a counted ``TypeError``. :func:`check_adapter`
compares every protocol method's parameters with the implementation's (by name, kind and
arity, through :func:`inspect.signature`) and returns the problems as sentences, so a test or
the Monitor at start can say exactly what is wrong. An empty list means it conforms.

What counts as compatible is what a caller written against the protocol may do: pass every
protocol parameter positionally in order, or by its name. An implementation may add
parameters with defaults, and may take ``*args``/``**kwargs`` instead of named ones.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Collection
from typing import Any

from sidecar.core.capabilities import Capability, declared
from sidecar.core.protocol import Adapter

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_BY_NAME = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def protocol_members(protocol: type) -> dict[str, Callable[..., Any] | None]:
    """The protocol's own members: method name -> function, attribute name -> ``None``."""
    members: dict[str, Callable[..., Any] | None] = {}
    for klass in reversed(protocol.__mro__):
        if klass is object or not getattr(klass, "_is_protocol", False):
            continue
        if klass.__name__ in ("Protocol", "Generic"):
            continue
        for name in getattr(klass, "__annotations__", {}):
            members.setdefault(name, None)
        for name, value in vars(klass).items():
            if name.startswith("_"):
                continue
            if inspect.isfunction(value):
                members[name] = value
    return members


def _signature(obj: Any, name: str) -> inspect.Signature | None:
    """The signature a caller sees: bound methods without ``self``; for a class, its plain
    functions without their first parameter."""
    member = getattr(obj, name)
    try:
        sig = inspect.signature(member)
    except (TypeError, ValueError):
        return None
    if inspect.isclass(obj) and inspect.isfunction(inspect.getattr_static(obj, name)):
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    return sig


def _caller_params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())[1:]  # without self


def signature_problems(name: str, expected: Callable[..., Any],
                       actual: inspect.Signature) -> list[str]:
    """Why a call written against ``expected`` could fail on ``actual`` (empty: it can't)."""
    want = _caller_params(expected)
    have = list(actual.parameters.values())
    var_pos = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in have)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in have)
    positional = [p for p in have if p.kind in _POSITIONAL]
    named = {p.name: p for p in have if p.kind in _BY_NAME}
    out: list[str] = []
    want_pos = [p for p in want if p.kind in _POSITIONAL]
    if len(want_pos) > len(positional) and not var_pos:
        out.append(f"{name}() takes {len(positional)} positional argument(s), the protocol "
                   f"passes {len(want_pos)} ({', '.join(p.name for p in want_pos)})")
    for i, p in enumerate(want_pos):
        if i >= len(positional):
            break
        mine = positional[i]
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            if mine.name != p.name and not var_kw:
                out.append(f"{name}(): parameter {i + 1} is {mine.name!r}, the protocol "
                           f"names it {p.name!r}")
            elif mine.kind is inspect.Parameter.POSITIONAL_ONLY and not var_kw:
                out.append(f"{name}(): {p.name!r} is positional-only, the protocol allows "
                           "it by name")
    for p in want:
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in named and not var_kw:
            out.append(f"{name}(): no keyword parameter {p.name!r}")
        if p.kind is inspect.Parameter.VAR_POSITIONAL and not var_pos:
            out.append(f"{name}(): does not take *{p.name}")
        if p.kind is inspect.Parameter.VAR_KEYWORD and not var_kw:
            out.append(f"{name}(): does not take **{p.name}")
    wanted_names = {p.name for p in want}
    for i, mine in enumerate(have):
        if mine.default is not inspect.Parameter.empty or mine.kind not in (*_POSITIONAL,
                                                                             *_BY_NAME):
            continue
        if mine.kind in _POSITIONAL and i < len(want_pos):
            continue
        if mine.kind is inspect.Parameter.KEYWORD_ONLY and mine.name in wanted_names:
            continue
        out.append(f"{name}(): requires {mine.name!r}, which the protocol never passes")
    return out


def check_protocol(obj: Any, protocol: type) -> list[str]:
    """Every way ``obj`` (an instance, or a class) fails to implement ``protocol``."""
    out: list[str] = []
    for name, expected in protocol_members(protocol).items():
        if not hasattr(obj, name):
            kind = "attribute" if expected is None else "method"
            out.append(f"missing {kind} {name!r}")
            continue
        if expected is None:
            continue
        member = getattr(obj, name)
        if not callable(member):
            out.append(f"{name!r} is not callable")
            continue
        if inspect.iscoroutinefunction(member) and not inspect.iscoroutinefunction(expected):
            out.append(f"{name}() is async; the protocol calls it synchronously")
        actual = _signature(obj, name)
        if actual is None:
            continue  # a builtin without a readable signature: nothing to compare
        out.extend(signature_problems(name, expected, actual))
    return out


def capability_problems(obj: Any, cap: Capability) -> list[str]:
    """Why ``obj``'s ``cap`` member cannot be used as declared (empty: it can, or ``obj``
    does not offer it). A value is read once and checked against the allowed values."""
    if not hasattr(obj, cap.name):
        return []
    if cap.values is None:
        return check_protocol(obj, cap.protocol)
    if inspect.isclass(obj) and isinstance(inspect.getattr_static(obj, cap.name), property):
        return []  # a property's value exists only on an instance
    try:
        value = getattr(obj, cap.name)
    except Exception as exc:  # a property that raises
        return [f"{cap.name!r} could not be read: {exc!r}"]
    if type(value) is not type(cap.values[0]) or value not in cap.values:
        return [f"{cap.name} = {value!r} is not one of "
                f"{', '.join(repr(v) for v in cap.values)}"]
    return []


def misspelt(obj: Any, owner: str, known: set[str]) -> dict[str, str]:
    """Public members of ``obj`` whose names look like a declared capability of ``owner``
    without being one (or any other known member): member -> the capability it resembles."""
    names = declared(owner)
    capability_names = [c.name for c in names]
    # The class's members only: reading an instance's ``__dict__`` (``dir`` does) makes
    # CPython 3.11 move its attributes into a real dict for good, and every attribute load
    # on it slower: on the engine's own adapter object, and on the sampler, whose
    # ``should_sample`` ran at half speed on every hit after attach. A capability set on the
    # instance is still found by name (``capability_problems``); only its misspelling is not.
    members = set(dir(obj if inspect.isclass(obj) else type(obj)))
    out: dict[str, str] = {}
    for member in sorted(members):
        if member.startswith("_") or member in known or member in capability_names:
            continue
        close = difflib.get_close_matches(member, capability_names, n=1, cutoff=0.85)
        if close:
            out[member] = close[0]
    return out


def check_capabilities(obj: Any, owner: str, known: Collection[str] = ()
                       ) -> dict[str, list[str]]:
    """Problems per declared capability of ``owner`` that ``obj`` offers (wrong signature,
    a value outside the declared ones) or seems to mean (a misspelt name): capability name
    -> sentences naming it. Capabilities without a problem are left out."""
    out: dict[str, list[str]] = {}
    for cap in declared(owner):
        problems = capability_problems(obj, cap)
        if problems:
            out.setdefault(cap.name, []).extend(
                f"{cap.protocol.__name__}: {p}" for p in problems)
    for member, meant in misspelt(obj, owner, set(known)).items():
        out.setdefault(meant, []).append(
            f"{member!r} is not a capability: did you mean {meant!r}? (ignored)")
    return out


def check_adapter(adapter: Any) -> list[str]:
    """Problems of ``adapter`` against :class:`~sidecar.core.protocol.Adapter` and against
    every optional capability it offers or seems to mean (:data:`CAPABILITIES`: absent is
    fine, present with a wrong signature or value, or misspelt, is not). Each problem names
    the protocol; an empty list means the adapter conforms."""
    name = type(adapter).__name__ if not inspect.isclass(adapter) else adapter.__name__
    out = [f"{name}: Adapter: {p}" for p in check_protocol(adapter, Adapter)]
    known = set(protocol_members(Adapter))
    for problems in check_capabilities(adapter, "adapter", known).values():
        out += [f"{name}: {p}" for p in problems]
    return out
