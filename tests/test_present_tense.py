"""The product speaks in the present tense (docs/development.md, STYLE.md habit 8).

`klppo/` says what the code does and why: no numbered work periods, no dates, no pointers to the removed
benchmark diaries (the names :data:`HISTORY` matches); figures and history live in
`docs/performance.md`, commit bodies and issue notes. Config help texts are one sentence of at most
`HELP_MAX_CHARS` characters, and the guide section a help text names (`see=`) exists, so the links of the
generated `docs/configuration.md` lead somewhere.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from klppo.config._field import HELP_MAX_CHARS
from klppo.config._walk import hints, is_group
from klppo.config.schema import KLPPOConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HISTORY = re.compile(
    r"\bsession \d|RESULTS\.md|PENDING\.md|\b20\d\d-[01]\d-[0-3]\d\b",
    re.IGNORECASE,
)


def _history_lines(*roots: Path) -> list[str]:
    hits = []
    for path in sorted(p for root in roots for p in ([root] if root.is_file() else root.rglob("*"))):
        if path.suffix not in (".py", ".yaml", ".md") or "__pycache__" in path.parts:
            continue
        if path in (Path(__file__).resolve(), DOCS / "performance.md"):  # the pattern's own text; the record
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    return hits


def test_no_history_in_the_package():
    hits = _history_lines(ROOT / "klppo")
    assert not hits, f"{len(hits)} lines of history in klppo/ (say what the code does):\n" + "\n".join(hits)


def test_no_history_in_docs_tests_benchmarks_and_examples():
    """The same for what maintainers read; docs/performance.md, the one record of figures, is left out."""
    roots = [ROOT / "README.md", DOCS, ROOT / "tests", ROOT / "bench", ROOT / "examples"]
    hits = _history_lines(*roots)
    assert not hits, f"{len(hits)} lines of history (say what is, not when):\n" + "\n".join(hits)


def _fields() -> list[tuple[str, dataclasses.Field]]:
    """(dotted key, field) of every schema key, groups included."""
    out = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            out.append((prefix + f.name, f))
            tp = hints(cls)[f.name]
            if is_group(tp):
                walk(tp, prefix + f.name + ".")

    walk(KLPPOConfig, "")
    return out


def test_help_texts_are_short():
    long = [
        f"{key} ({len(f.metadata['help'])})"
        for key, f in _fields()
        if len(f.metadata["help"]) > HELP_MAX_CHARS
    ]
    assert not long, (
        f"help texts over {HELP_MAX_CHARS} characters (move the detail to a guide, see=):\n" + "\n".join(long)
    )


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(guide: Path) -> set[str]:
    lines, fenced = [], False
    for line in guide.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            lines.append(line.lstrip("#"))
    return {_anchor(h) for h in lines}


def test_help_links_reach_a_guide_section():
    broken = []
    for key, f in _fields():
        see = f.metadata.get("see", "")
        if not see:
            continue
        name, _, anchor = see.partition("#")
        guide = DOCS / name
        if not guide.is_file() or (anchor and anchor not in _anchors(guide)):
            broken.append(f"{key}: {see}")
    assert not broken, "see= names no guide section:\n" + "\n".join(sorted(set(broken)))


def test_files_the_docs_name_exist():
    """Every ``klppo/…``, ``tests/…`` or ``bench/…`` Python file the README and docs/ name is in the tree."""
    named = set()
    for doc in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        named |= {(doc.name, m) for m in re.findall(r"\b(?:klppo|tests|bench)/[\w/]+\.py\b", doc.read_text())}
    missing = sorted(f"{doc}: {path}" for doc, path in named if not (ROOT / path).is_file())
    assert not missing, missing
