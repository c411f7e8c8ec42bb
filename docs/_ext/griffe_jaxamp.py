"""A griffe extension that makes jaxamp's docstrings render as Markdown.

The docstrings are written for ``help()`` and doctest: Sphinx roles (``:func:`autocast```) name
other objects, and doctest examples (``>>>`` lines) sit in the text. Before mkdocstrings renders
them, this extension turns

* each role into a cross-reference (``[`autocast`][jaxamp._autocast.autocast]``), resolved
  from the docstring's own module, its class, then the public modules. A name that resolves to
  nothing stays a reference to itself, which the strict build reports as broken;
* each run of doctest lines (and their expected output) into a fenced ``pycon`` block.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:class|func|meth|attr|data|obj|exc|mod):`(~?)([\w.]+)`")
_PUBLIC_MODULES = ("jaxamp", "jaxamp.fp8", "jaxamp.ops")


def _resolve(name: str, obj: griffe.Object, package: griffe.Module) -> str | None:
    """The canonical path of ``name`` as seen from ``obj``'s docstring, or None."""
    scopes = []
    if obj.is_class:
        scopes.append(obj.path)
    if obj.parent is not None:
        scopes.append(obj.parent.path)
        if obj.parent.parent is not None:
            scopes.append(obj.parent.parent.path)
    scopes += [obj.module.path, *_PUBLIC_MODULES, ""]
    for scope in scopes:
        path = f"{scope}.{name}" if scope else name
        if not path.startswith("jaxamp"):
            continue
        try:
            relative = path.removeprefix("jaxamp").lstrip(".")
            found = package[relative] if relative else package
        except (KeyError, ValueError):
            continue
        try:
            return found.final_target.path if found.is_alias else found.path
        except griffe.AliasResolutionError:
            continue
    return None


def _fence_doctests(text: str) -> str:
    """Wraps each run of doctest lines and their expected output in a ```pycon fence."""
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if not stripped.startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(stripped)]
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


class JaxampDocstrings(griffe.Extension):
    """Rewrites every docstring of the package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        if pkg.name != "jaxamp":
            return
        for obj in _walk(pkg):
            if obj.docstring is None:
                continue
            value = _fence_doctests(obj.docstring.value)

            def link(match: re.Match, obj=obj) -> str:
                short, name = match.groups()
                path = _resolve(name, obj, pkg) or name
                shown = name.rsplit(".", 1)[-1] if short else name
                return f"[`{shown}`][{path}]"

            obj.docstring.value = _ROLE.sub(link, value)


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if member.is_alias:
            continue
        yield from _walk(member)
