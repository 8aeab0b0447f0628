"""Every number a lesson quotes is traceable: a quoted measurement is a link to its source, and the source holds it.

A lesson writes a measured number as a link:

- to a committed JSON, with a JSON pointer (RFC 6901) after `#`: `[1.36×](../assets/benchmarks/x.json#/runs/0/ratio)`;
  `#/a/b:/c/d` quotes the ratio a/b ÷ c/d. The number shown must equal the value rounded to the digits shown (the
  value may be scaled by 1000, 1/1000 or 100 for ms/s and percent).
- to a committed notebook: `[4,997 ms](../notebooks/00_overview.ipynb)`: the number shown must appear in the
  notebook's saved outputs. Quote from a notebook only what a rerun reproduces (sizes, counts, computed values);
  timings come from JSONs, which record their machine and load average.

Numbers with a measured unit (ms, µs, tok/s, GFLOP/s, GOP/s) in a lesson's prose must be such links (or links to
a spec or paper on the web).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from minfer.course.text import without_code_and_comments

LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
NUMBER = re.compile(r"(?<![\w.])[-−]?\d[\d,]*(?:\.\d+)?")
MEASURED = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:ms|µs|us|tok/s|tokens/s|GFLOP/s|GOP/s"
                      r"|tokens per second|milliseconds|microseconds)\b")
SCALES = (1.0, 1000.0, 0.001, 100.0)


def _shown(text: str) -> tuple[float, int] | None:
    m = NUMBER.search(text)
    if not m:
        return None
    s = m.group(0).replace(",", "").replace("−", "-")
    decimals = len(s.split(".")[1]) if "." in s else 0
    return float(s), decimals


def _pointer(doc, pointer: str):
    cur = doc
    for part in pointer.lstrip("/").split("/") if pointer.strip("/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(cur, list) and not part.isdigit():
            raise KeyError(f"{part!r} is not a list index")
        cur = cur[int(part)] if isinstance(cur, list) else cur[part]
    return cur


def json_value(path: Path, fragment: str) -> float:
    """The number a `#pointer` or `#pointer:pointer` fragment names in the JSON at `path`.

    Raises:
        KeyError, IndexError, ValueError: when the pointer names nothing numeric.
    """
    doc = json.loads(Path(path).read_text())

    def number(pointer: str) -> float:
        v = _pointer(doc, pointer)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{pointer} holds {v!r}, not a number")
        return float(v)

    if ":" in fragment:
        a, b = fragment.split(":", 1)
        den = number(b)
        if den == 0:
            raise ValueError(f"{b} is 0")
        return number(a) / den
    return number(fragment)


def notebook_output_text(path: Path) -> str:
    """All saved output text of a notebook (streams, text/plain and text/markdown results)."""
    p = Path(path).resolve()
    return _notebook_output_text(p, p.stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _notebook_output_text(path: Path, mtime_ns: int) -> str:  # a lesson links one notebook many times
    out = []
    for c in json.loads(path.read_text())["cells"]:
        for o in c.get("outputs", []):
            if "text" in o:
                out.append("".join(o["text"]))
            for key in ("text/plain", "text/markdown", "text/html"):
                if key in o.get("data", {}):
                    out.append("".join(o["data"][key]))
    return "\n".join(out)


def check_link(lesson: Path, text: str, target: str) -> str | None:
    """None when the link's number matches its source, else what is wrong."""
    shown = _shown(text)
    if shown is None:
        return None
    value, decimals = shown
    file, _, fragment = target.partition("#")
    if file.startswith(("http://", "https://")):
        return None
    path = (lesson.parent / file).resolve()
    if file.endswith(".json"):
        if not path.is_file():
            return f"[{text}]({target}): {file} does not exist"
        if not fragment:
            return f"[{text}]({target}): a JSON source needs a #/json/pointer to the value"
        try:
            v = json_value(path, fragment)
        except (KeyError, IndexError, ValueError, TypeError) as e:
            return f"[{text}]({target}): the pointer names no number ({e!r})"
        # the same sign, and a shown 0 only for a value that is 0 (not a small one scaled by 1/1000)
        if not any(round(v * s, decimals) == round(value, decimals) and (value != 0 or v == 0) for s in SCALES):
            return f"[{text}]({target}): the JSON holds {v!r}, the lesson says {value}"
        return None
    if file.endswith(".ipynb"):
        if not path.is_file():
            return f"[{text}]({target}): {file} does not exist"
        out = notebook_output_text(path).replace(",", "")
        token = NUMBER.search(text).group(0).replace(",", "")
        if not re.search(rf"(?<![\d.]){re.escape(token)}(?!\d|\.\d)", out):
            return f"[{text}]({target}): {token} is not in the notebook's saved outputs"
        return None
    return None


def problems(lesson: Path) -> list[str]:
    """Every quoted number in `lesson` that does not match its source, and every measured number without one."""
    md = without_code_and_comments(Path(lesson).read_text())
    out = []
    for text, target in LINK.findall(md):
        p = check_link(Path(lesson), text, target)
        if p:
            out.append(p)
    unlinked = LINK.sub("", md)
    unlinked = re.sub(r"`[^`]*`", "", unlinked)
    for line in unlinked.splitlines():
        if line.lstrip().startswith("|") and "|" in line.strip()[1:]:
            continue  # tables: their rows are checked where a test names them
        for m in MEASURED.finditer(line):
            out.append(f"measured number without a source link: {m.group(0)!r} in: {line.strip()[:120]}")
    return out
