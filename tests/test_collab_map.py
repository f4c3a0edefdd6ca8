"""collab's docstring maps docs/math.md#math to functions: every name it gives must exist, so the
map
cannot silently go stale when code moves."""

from __future__ import annotations

import importlib
import pkgutil
import re

import collab


def test_every_name_in_the_map_exists():
    modules = {m.name for m in pkgutil.iter_modules(collab.__path__)}
    found = re.findall(r"\b([a-z_]+(?:\.[A-Za-z_]\w*)+)\b", collab.__doc__ or "")
    names = [n for n in found if n.split(".")[0] in modules]
    assert len(names) > 30
    missing = []
    for dotted in names:
        parts = dotted.split(".")
        obj = importlib.import_module(f"collab.{parts[0]}")
        for i, part in enumerate(parts[1:], 1):
            if not hasattr(obj, part):
                try:
                    obj = importlib.import_module("collab." + ".".join(parts[: i + 1]))
                    continue
                except ModuleNotFoundError:
                    missing.append(dotted)
                    break
            obj = getattr(obj, part)
    assert not missing, f"collab's map names what does not exist: {missing}"
