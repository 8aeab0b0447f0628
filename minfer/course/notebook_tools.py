"""Notebook operations for the course: find exercise cells, blank their solutions for a learner's copy.

An exercise cell is tagged `exercise`; its solution sits between `### BEGIN SOLUTION` and `### END SOLUTION`
lines (nbgrader's convention). Blanking replaces those lines with `raise NotImplementedError(...)` at the same
indentation, so the check cell after it fails until the learner writes the code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def cells(nb_path: Path) -> list[dict]:
    return json.loads(Path(nb_path).read_text())["cells"]


def source(cell: dict) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def tags(cell: dict) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def exercises(nb_path: Path) -> list[tuple[dict, dict | None]]:
    """(exercise cell, the code cell after it) for each cell tagged `exercise`."""
    cs = cells(nb_path)
    out = []
    for i, c in enumerate(cs):
        if c["cell_type"] == "code" and "exercise" in tags(c):
            nxt = next((d for d in cs[i + 1:] if d["cell_type"] == "code"), None)
            out.append((c, nxt))
    return out


def blank(src: str, label: str = "this exercise") -> str:
    """The exercise's source with each solution block replaced by a NotImplementedError at its indentation.

    Raises:
        ValueError: when the cell has no complete solution block.
    """
    pattern = re.compile(rf"^([ \t]*){re.escape(BEGIN)}[^\n]*\n.*?^[ \t]*{re.escape(END)}[^\n]*(\n|$)", re.S | re.M)
    begins = len(re.findall(rf"^[ \t]*{re.escape(BEGIN)}", src, re.M))
    ends = len(re.findall(rf"^[ \t]*{re.escape(END)}", src, re.M))
    if not begins or begins != ends:
        raise ValueError(f"{label}: {begins} '{BEGIN}' and {ends} '{END}' lines; each solution needs one of each")
    return pattern.sub(lambda m: f'{m.group(1)}raise NotImplementedError("your code here")\n', src)


def learner_copy(nb_path: Path, out_path: Path, force: bool = False) -> int:
    """Write a copy of the notebook with every exercise's solution blanked and every output cleared; returns the
    number of exercises blanked.

    Raises:
        FileExistsError: `out_path` exists (a learner's work would be lost) and `force` is False.
        ValueError: `out_path` is the notebook itself.
    """
    if Path(out_path).resolve() == Path(nb_path).resolve():
        raise ValueError(f"refusing to blank {nb_path} in place: give another folder")
    if Path(out_path).exists() and not force:
        raise FileExistsError(f"{out_path} exists (your work?); pass --force to overwrite it")
    nb = json.loads(Path(nb_path).read_text())
    n = 0
    for c in nb["cells"]:
        if c["cell_type"] != "code":
            continue
        c["outputs"], c["execution_count"] = [], None
        if "exercise" in tags(c):
            c["source"] = blank(source(c), f"{Path(nb_path).name}").splitlines(keepends=True)
            n += 1
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return n
