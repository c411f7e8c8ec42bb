"""The documentation's code runs as written, and every public name has a documented page.

Every ```python block of a page under docs/ runs, in page order, in one namespace per page (a
page's later blocks may use what its earlier ones defined). A block that cannot run here (a
PyTorch snippet, a multi-host launch) is preceded by an HTML comment ``<!-- not run: why -->``,
which the rendered page does not show; a page's ```text, ```bash and ```pycon blocks are shown
and never run. `make docs` builds the site itself, in strict mode.
"""

import html.parser
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_BLOCK = re.compile(r"(<!-- not run: [^>]+ -->\n)?```python\n(.*?)```", flags=re.S)


def python_blocks(path: pathlib.Path) -> tuple[list[str], int]:
    """The ```python blocks of a markdown page that run, and how many are marked not run."""
    blocks, not_run = [], 0
    for marker, code in _BLOCK.findall(path.read_text()):
        if marker:
            not_run += 1
        else:
            blocks.append(code)
    return blocks, not_run


PAGES = sorted(p for p in DOCS.rglob("*.md") if "_ext" not in p.parts)


def test_the_docs_have_pages_with_code():
    runnable = [p for p in PAGES if python_blocks(p)[0]]
    assert len(PAGES) >= 15 and len(runnable) >= 8, (len(PAGES), len(runnable))


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)[0]],
                         ids=lambda p: str(p.relative_to(DOCS)))
def test_page_examples_run(page):
    blocks, _ = python_blocks(page)
    namespace: dict = {"__name__": "__docs__"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{page}:block{i}", "exec"), namespace)  # noqa: S102
        except Exception as e:  # name the block that failed
            raise AssertionError(f"{page.relative_to(ROOT)}, python block {i}: {e!r}") from e


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "_ext" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_has_a_docstring_and_an_api_entry():
    """The check `make docs` runs before building: it fails the build on a public name (of
    ``jaxamp``, ``jaxamp.fp8`` and ``jaxamp.ops``, or a public member of a public class) with
    no docstring, or with no ``::: name`` entry in docs/api/."""
    hooks = _hooks()
    problems = hooks.api_problems(DOCS)
    assert problems == [], "\n".join(problems)
    names = hooks.public_names()
    assert {"jaxamp.autocast", "jaxamp.fp8.Linear", "jaxamp.ops.layer_norm",
            "jaxamp.state.find_state", "jaxamp.reports.AuditReport"} <= set(names)
    assert len(names) >= 70


def test_the_api_check_catches_a_missing_entry(tmp_path):
    hooks = _hooks()
    api = tmp_path / "api"
    api.mkdir()
    for page in (DOCS / "api").glob("*.md"):
        (api / page.name).write_text(page.read_text().replace("::: jaxamp.autocast\n", ""))
    assert any("jaxamp.autocast" in p for p in hooks.api_problems(tmp_path))


def test_the_home_page_and_the_readme_show_the_same_features_and_figures():
    def section(text: str, title: str) -> str:
        return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]

    readme = (ROOT / "README.md").read_text()
    home = (DOCS / "index.md").read_text()
    assert section(home, "Features") == section(readme, "Features")
    assert section(home, "Measured") == section(readme, "Measured").replace(
        "(BENCHMARKS.md)", "(benchmarks.md)")


class _Page(html.parser.HTMLParser):
    """The ids, the links and the link texts of one built page."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        found = dict(attrs)
        if found.get("id"):
            self.ids.add(found["id"])
        if tag == "a" and found.get("name"):
            self.ids.add(found["name"])
        if tag == "a" and found.get("href") is not None:
            self._href, self._text = found["href"], []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append((self._href, " ".join("".join(self._text).split())))
            self._href = None


def _site_links(site: pathlib.Path) -> tuple[list[str], list[str]]:
    """``(broken, blank)``: the internal links of the built site whose page or anchor is
    missing (the tables of contents included), and the navigation and contents entries whose
    text lost its code (``": mixed precision"``, ``"Overrides: , ,"``)."""
    pages = {}
    for path in site.rglob("*.html"):
        page = _Page()
        page.feed(path.read_text(errors="replace"))
        pages[path] = page
    broken, blank = [], []
    for path, page in pages.items():
        for href, text in page.links:
            if re.match(r"[a-z][a-z0-9+.-]*:", href) or href.startswith("//"):
                continue  # another site
            target, _, anchor = href.partition("#")
            base = site if target.startswith("/") else path.parent  # the 404 page's
            dest = (base / target.lstrip("/")).resolve() if target else path
            if dest.is_dir():
                dest = dest / "index.html"
            where = f"{path.relative_to(site)}: {href}"
            if dest not in pages:
                if not dest.exists():
                    broken.append(where)
                continue
            if anchor and anchor not in pages[dest].ids:
                broken.append(where)
            if anchor and (text.startswith((":", ",")) or re.search(r"\s,\s*,|:\s*,", text)):
                blank.append(f"{where} ({text!r})")
    return broken, blank


def _site_copy(root: pathlib.Path) -> pathlib.Path:
    """What `make docs` reads, copied: the config, the pages, the package, the notebooks and the
    repository files the site shows."""
    for name in ("mkdocs.yml", "BENCHMARKS.md", "CHANGELOG.md"):
        shutil.copy(ROOT / name, root / name)
    for name in ("docs", "jaxamp", "notebooks"):
        shutil.copytree(ROOT / name, root / name,
                        ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    shutil.copytree(ROOT / "benchmarks" / "results", root / "benchmarks" / "results")
    return root


def _break(root: pathlib.Path, breakage: str) -> None:
    if breakage == "reference_and_link":  # both are reported before the build aborts
        page = root / "docs" / "getting-started.md"
        page.write_text(page.read_text() + "\nSee [`nothing`][jaxamp.no_such_name].\n")
        page = root / "docs" / "concepts" / "policies.md"
        page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    elif breakage == "notebook":
        (root / "notebooks" / "01_quickstart.ipynb").write_text('{"cells": [')
    elif breakage == "docstring":
        module = root / "jaxamp" / "_optimizer" / "_rounding.py"
        module.write_text(module.read_text().replace(
            '"""The fp32 value that :func:`kahan_split` split into ``high`` and ``low``."""',
            "pass"))


# The unbroken build and the missing docstring run in `make test`; the other two breakages,
# which the same strict mode catches, in `make test-all`.
@pytest.mark.parametrize("breakage", ["none", pytest.param("reference_and_link",
                                                           marks=pytest.mark.slow),
                                      pytest.param("notebook", marks=pytest.mark.slow),
                                      "docstring"])
def test_the_strict_build_fails_on_a_broken_page(breakage, tmp_path):
    """`make docs` builds in strict mode: the unbroken copy builds, and each breakage fails."""
    root = _site_copy(tmp_path)
    _break(root, breakage)
    mkdocs = pathlib.Path(sys.executable).parent / "mkdocs"
    result = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")],
                            cwd=root, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    if breakage == "none":
        assert result.returncode == 0, result.stderr[-3000:]
        assert (tmp_path / "site" / "api" / "index.html").exists()
        assert (tmp_path / "site" / "notebooks" / "01_quickstart" / "index.html").exists()
        broken, blank = _site_links(tmp_path / "site")
        assert broken == [], broken[:20]
        assert blank == [], blank[:20]
    else:
        assert result.returncode != 0, f"the build passed despite a broken {breakage}"
        expected = {"reference_and_link": ["jaxamp.no_such_name", "no-such-page.md"],
                    "notebook": ["01_quickstart"],
                    "docstring": ["jaxamp.rounding.kahan_join has no docstring"]}
        for message in expected[breakage]:
            assert message in result.stderr + result.stdout, result.stderr[-3000:]
