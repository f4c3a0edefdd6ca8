"""The split variants, one module each, and the one registry every reader uses: the device,
the cloud, the CLI's `--variant` choices, the settings screen and the benchmarks.

Adding a variant: one module with a `SplitVariant` subclass (`collab.variants.base`) and one
line in `_BUILT_IN` (or `register()` from outside, as the tests do). The table names classes
rather than importing them, so reading the names (settings, CLI) stays free of numpy."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collab.variants.base import SplitVariant

_BUILT_IN: dict[str, str] = {  # name → module:class
    "tk-slt": "collab.variants.tk_slt:TkSlt",
    "dssd": "collab.variants.dssd:Dssd",
    "dssd-topk": "collab.variants.dssd:DssdTopK",
    "dsd": "collab.variants.dsd:Dsd",
}
DEFAULT_VARIANT = "tk-slt"
_registered: dict[str, SplitVariant] = {}


def variant_names() -> list[str]:
    """Every variant's name, built-in ones first (the default first of all)."""
    return [*_BUILT_IN, *(n for n in _registered if n not in _BUILT_IN)]


def get_variant(name: str) -> SplitVariant:
    """The variant called `name`; a ValueError naming the choices otherwise."""
    if name not in _registered:
        if name not in _BUILT_IN:
            choices = ", ".join(variant_names())
            raise ValueError(f"unknown split variant {name!r}; one of {choices}")
        module, cls = _BUILT_IN[name].split(":")
        _registered[name] = getattr(import_module(module), cls)()
    return _registered[name]


def all_variants() -> list[SplitVariant]:
    return [get_variant(n) for n in variant_names()]


def rapid_variants() -> list[str]:
    """The variants whose cloud can verify against RAPID's target (it holds each draft's Q)."""
    return [v.name for v in all_variants() if v.rapid]


def register(variant: SplitVariant) -> SplitVariant:
    """Add a variant (both sides see it: they read this registry)."""
    _registered[variant.name] = variant
    return variant


def unregister(name: str) -> None:
    """Forget a variant added with `register` (tests)."""
    if name not in _BUILT_IN:
        _registered.pop(name, None)
