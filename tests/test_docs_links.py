"""Every relative link and anchor in README.md and docs/*.md resolves (issue 33, point 8: the README split
into a landing page and docs/).  Links are read by markdown-it-py (the CommonMark parser rich uses), so a
link inside a code block is not a link; anchors are made the way GitHub makes them (github-slugger:
lower-case, drop every character that is not a letter, digit, mark, space, ``-`` or ``_``, spaces to
``-``, ``-1``, ``-2`` ... for repeats).  The last test feeds the checker a page with a broken file link
and a broken anchor and sees both reported, so the check can fail."""

from __future__ import annotations

import unicodedata
from pathlib import Path
from urllib.parse import unquote, urlsplit

from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(text: str) -> str:
    kept = "".join(c for c in text.lower() if unicodedata.category(c)[0] in "LNM" or c in " -_")
    return kept.replace(" ", "-")


def _tokens(path: Path) -> list:
    return MarkdownIt("commonmark").enable("table").parse(path.read_text(encoding="utf-8"))


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    tokens = _tokens(path)
    for i, tok in enumerate(tokens):
        if tok.type != "heading_open":
            continue
        inline = tokens[i + 1]
        text = "".join(c.content for c in inline.children or [] if c.type in ("text", "code_inline"))
        base, n = slug(text), 0
        name = base
        while name in found:
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def links(path: Path) -> list[str]:
    out: list[str] = []
    for tok in _tokens(path):
        for child in tok.children or []:
            target = child.attrGet("href") if child.type == "link_open" else child.attrGet("src")
            if isinstance(target, str):
                out.append(target)
    return out


def broken(path: Path) -> list[str]:
    """Each relative link of ``path`` whose file or anchor does not exist."""
    problems = []
    for target in links(path):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc:
            continue  # absolute URLs are not ours to check offline
        dest = (path.parent / unquote(parts.path)).resolve() if parts.path else path
        if not dest.exists():
            problems.append(f"{path.name}: {target}: no such file")
        elif parts.fragment and dest.suffix == ".md" and parts.fragment not in anchors(dest):
            problems.append(f"{path.name}: {target}: no heading #{parts.fragment} in {dest.name}")
    return problems


def test_every_relative_link_and_anchor_resolves() -> None:
    assert len(PAGES) > 5 and (ROOT / "docs" / "benchmarks.md") in PAGES
    checked = sum(len(links(p)) for p in PAGES)
    assert checked > 40  # the README's contents alone link every page of docs/
    assert [problem for page in PAGES for problem in broken(page)] == []


def test_the_readme_links_every_page_of_docs() -> None:
    targets = {urlsplit(t).path for t in links(ROOT / "README.md")}
    assert {f"docs/{p.name}" for p in PAGES[1:]} <= targets


def test_the_checker_reports_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title: `one`\n\n## Two\n\n[ok](#title-one) [ok](#two) [bad](#three) [gone](nothere.md)\n"
                    "```\n[in code](nowhere.md)\n```\n", encoding="utf-8")
    assert anchors(page) == {"title-one", "two"}
    assert broken(page) == ["page.md: #three: no heading #three in page.md", "page.md: nothere.md: no such file"]
