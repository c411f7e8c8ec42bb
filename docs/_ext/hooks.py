"""MkDocs hooks of the jaxamp site.

* Before the build, :func:`api_problems` checks that every public name (of ``jaxamp`` and its
  public subpackages, and every public member of a public class) has a docstring,
  and that each name has a ``::: name`` entry on a page of docs/api/. A problem fails the build.
* The repository's own files become pages without copies: the notebooks (rendered by
  mkdocs-jupyter with their committed outputs), BENCHMARKS.md with its charts, and CHANGELOG.md.
  Their links to files of the repository that are not pages point to the repository instead.
"""

from __future__ import annotations

import functools
import importlib
import pathlib
import re

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File
from mkdocs.structure.files import Files

ROOT = pathlib.Path(__file__).resolve().parents[2]
PUBLIC_MODULES = ("jaxamp", "jaxamp.equinox", "jaxamp.fp8", "jaxamp.gradients", "jaxamp.memory",
                  "jaxamp.ops", "jaxamp.parallel", "jaxamp.reports", "jaxamp.rounding",
                  "jaxamp.state")
# Repository files shown as pages: (source, page).
_PAGES = {"BENCHMARKS.md": "benchmarks.md", "CHANGELOG.md": "changelog.md"}
_LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")


def public_names() -> list[str]:
    """The dotted name of everything the public modules export (their ``__all__``); a name
    that ``jaxamp`` re-exports from a subpackage is documented once, at the top."""
    top = importlib.import_module("jaxamp")
    names = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        names += [f"{module_name}.{name}" for name in module.__all__
                  if module is top or name not in top.__all__]
    return names


@functools.cache  # loaded once per build: by the check before it and by the API table
def _package():
    import griffe

    return griffe.load("jaxamp", search_paths=[str(ROOT)], docstring_parser="google")


def _target(package, name: str):
    obj = package[name.removeprefix("jaxamp.")]
    return obj.final_target if obj.is_alias else obj


def _undocumented(names: list[str]) -> list[str]:
    package = _package()
    missing = []
    for name in names:
        target = _target(package, name)
        if not target.docstring:
            missing.append(name)
        if not target.is_class:
            continue
        for member_name, member in target.all_members.items():
            if member_name.startswith("_"):
                continue
            member = member.final_target if member.is_alias else member
            if member.is_module or not member.path.startswith("jaxamp."):
                continue  # inherited from flax or optax, documented there
            if not member.docstring:
                missing.append(f"{name}.{member_name}")
    return missing


def api_problems(docs_dir: pathlib.Path) -> list[str]:
    """Every public name without a docstring, and every one without a ``::: name`` entry in
    ``docs_dir/api/*.md``; an empty list when all are documented."""
    names = public_names()
    problems = [f"{name} has no docstring" for name in _undocumented(names)]
    entries = set()
    for page in (docs_dir / "api").glob("*.md"):
        entries |= set(re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), flags=re.M))
    modules = set(_MODULE_PAGES)
    problems += [f"{name} has no '::: {name}' entry on a page of docs/api/"
                 for name in names if name not in entries and name not in modules]
    problems += [f"docs/api/ documents {entry}, which is not a public name"
                 for entry in sorted(entries - set(names) - modules)]
    return problems


def on_pre_build(config) -> None:
    _package.cache_clear()  # `mkdocs serve` rebuilds in one process: read the edited sources
    problems = api_problems(pathlib.Path(config["docs_dir"]))
    if problems:
        raise PluginError("the API reference is incomplete:\n  " + "\n  ".join(problems))


def _generated(config, src_uri: str, path: pathlib.Path) -> File:
    return File.generated(config, src_uri, abs_src_path=str(path))


@event_priority(100)  # before mkdocs-jupyter's, which picks up the notebooks added here
def on_files(files: Files, config) -> Files:
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        # A File read from the repository root: mkdocs-jupyter's wrapper recomputes the
        # source path from src_dir, which a generated File does not have.
        files.append(File(f"notebooks/{notebook.name}", src_dir=str(ROOT),
                          dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    files.append(_generated(config, "notebooks/index.md", ROOT / "notebooks" / "README.md"))
    for source, page in _PAGES.items():
        files.append(_generated(config, page, ROOT / source))
    for chart in sorted((ROOT / "benchmarks" / "results").glob("*.png")):
        files.append(_generated(config, f"benchmarks/results/{chart.name}", chart))
    return files


def _to_repository(match: re.Match, page_dir: pathlib.Path, files: Files, repo: str) -> str:
    """A link from a repository file to another repository file: to its page when it has one,
    else to the file in the repository."""
    text, target = match.groups()
    if re.match(r"[a-z]+:|#|/", target):
        return match.group(0)
    path, _, anchor = target.partition("#")
    source = (page_dir / path).resolve().relative_to(ROOT).as_posix()
    for src, page in _PAGES.items():
        if source == src:
            return f"{text}({page}{'#' + anchor if anchor else ''})"
    if files.get_file_from_path(source) is not None:
        return match.group(0)
    kind = "tree" if (ROOT / source).is_dir() else "blob"
    return f"{text}({repo}/{kind}/main/{source}{'#' + anchor if anchor else ''})"


# The public subpackages' own pages of docs/api/.
_MODULE_PAGES = {"jaxamp.equinox": "equinox.md", "jaxamp.fp8": "fp8.md",
                 "jaxamp.gradients": "gradients.md",
                 "jaxamp.memory": "memory.md", "jaxamp.ops": "ops.md",
                 "jaxamp.parallel": "parallel.md", "jaxamp.reports": "audit.md",
                 "jaxamp.rounding": "rounding.md", "jaxamp.state": "state.md"}


def api_table() -> str:
    """A markdown table of every public name, linked to its entry, with its docstring's first
    sentence."""
    package = _package()
    rows = ["| name | what it is |", "|---|---|"]
    for name in public_names():
        target = _target(package, name)
        doc = target.docstring.value if target.docstring else ""
        first = re.split(r"(?<=\.)\s|\n\n", doc.strip(), maxsplit=1)[0].replace("\n", " ")
        first = re.sub(r":\w+:`~?([\w.]+)`", r"`\1`", first).replace("``", "`").replace("|", "\\|")
        page = _MODULE_PAGES.get(name)
        link = f"[`{name}`]({page})" if page else f"[`{name}`][{name}]"
        rows.append(f"| {link} | {first} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    src = page.file.src_uri
    if src == "api/index.md":
        marker = "<!-- the table of public names: made by docs/_ext/hooks.py -->"
        if marker not in markdown:
            raise PluginError(f"docs/api/index.md lost its marker {marker}")
        markdown = markdown.replace(marker, api_table())
    if src in _PAGES.values() or src == "notebooks/index.md":
        origin = {v: k for k, v in _PAGES.items()}.get(src, "notebooks/README.md")
        page_dir = (ROOT / origin).parent
        repo = config["repo_url"].rstrip("/")
        markdown = _LINK.sub(lambda m: _to_repository(m, page_dir, files, repo), markdown)
    return markdown
