"""How the course measures a lesson: words of prose, and paragraphs about machines rather than concepts.

Prose is the text a reader reads as sentences: fenced code, tables, HTML comments, images and link targets are
not prose. A "machine paragraph" names a CPU model, a load average, a JSON file or a commit; lessons keep at most
three and leave the rest to their lab notes (`chapters/lab/`).
"""

from __future__ import annotations

import re
from pathlib import Path

MACHINE = re.compile(r"Xeon|EPYC|Ryzen|\bZen ?\d|Core i\d|load average|\.json\b|\bcommit\b|`[0-9a-f]{7,40}`", re.I)


def without_code_and_comments(markdown: str) -> str:
    """`markdown` without HTML comments and fenced code blocks: what a reader reads as text and tables."""
    text = re.sub(r"<!--.*?-->", "", markdown, flags=re.S)
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)


def visible_paragraphs(markdown: str) -> list[str]:
    """The lesson's paragraphs as a reader sees them: no fenced code, tables, HTML comments, images; links
    reduced to their text."""
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", without_code_and_comments(markdown))
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    paras, cur = [], []
    for line in text.splitlines():
        if line.lstrip().startswith("|") or not line.strip():
            if cur:
                paras.append(" ".join(cur))
                cur = []
            continue
        cur.append(line.strip())
    if cur:
        paras.append(" ".join(cur))
    return paras


def prose_words(markdown: str) -> int:
    """Words of prose in a lesson (see the module's docstring for what is not prose)."""
    return sum(len(re.findall(r"[^\s#>*_-][^\s]*", p)) for p in visible_paragraphs(markdown))


def machine_paragraphs(markdown: str) -> list[str]:
    """The visible paragraphs that name a CPU model, a load average, a JSON file or a commit."""
    return [p for p in visible_paragraphs(markdown) if MACHINE.search(p)]


def report(paths: list[Path]) -> str:
    rows, total = [], 0
    for p in paths:
        md = Path(p).read_text()
        w = prose_words(md)
        total += w
        rows.append(f"{w:6d} words  {len(machine_paragraphs(md)):2d} machine paragraphs  {p}")
    rows.append(f"{total:6d} words in all")
    return "\n".join(rows)
