"""The README's course table: every section of the article (§0-§17) has a row, in the article's order, and
every chapter, notebook, module and test file a row names exists; every listed notebook is committed with
outputs. A row may say "not written yet" for a part that does not exist; `test_what_is_not_written_yet`
prints those rows, so the gaps stay visible in the test log.

    pytest tests/test_course.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = set(range(18))  # the article's §0-§17 (../shared/seed/OUTLINE.md)
MISSING = "not written yet"


def course_rows() -> list[dict]:
    text = (ROOT / "README.md").read_text()
    part = text.split("## The course", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in part.splitlines():
        if not line.startswith("| ") or line.startswith("| §") or set(line) <= {"|", "-", " "}:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 5, f"a course row needs 5 columns: {line}"
        sections, chapter, notebook, modules, tests = cells
        rows.append({"sections": [int(s) for s in re.findall(r"\d+", sections)], "chapter": chapter,
                     "notebook": notebook, "modules": modules, "tests": tests, "line": line})
    return rows


def test_every_section_has_a_row_in_the_articles_order():
    rows = course_rows()
    covered = {s for r in rows for s in r["sections"]}
    assert covered == SECTIONS, f"sections without a row: {sorted(SECTIONS - covered)}"
    firsts = [r["sections"][0] for r in rows]
    assert firsts == sorted(firsts), f"rows are not in the article's order: {firsts}"


def test_listed_files_exist():
    problems = []
    for r in course_rows():
        links = re.findall(r"\]\(([^)]+)\)", r["chapter"])
        if MISSING not in r["chapter"]:
            assert links, f"no chapter link: {r['line']}"
        for link in links:
            if not (ROOT / link).is_file():
                problems.append(f"chapter {link}")
        for nb in re.findall(r"`([^`]+\.ipynb)`", r["notebook"]):
            if not (ROOT / nb).is_file():
                problems.append(f"notebook {nb}")
        for t in re.findall(r"tests/[\w/]+\.py", r["tests"]):
            if not (ROOT / t).is_file():
                problems.append(f"test {t}")
        for m in re.findall(r"`([^`]+)`", r["modules"]):
            path = m.split(" ")[0].rstrip("/")
            if not path.endswith((".py", "/")) and "/" not in path and not path.endswith("csrc"):
                continue
            candidates = [ROOT / path, ROOT / "minfer" / path]
            if not any(c.exists() for c in candidates):
                problems.append(f"module {path}")
    assert not problems, f"listed in the course table but missing: {problems}"


@pytest.mark.parametrize("nb", sorted({nb for r in course_rows() for nb in re.findall(r"`([^`]+\.ipynb)`", r["notebook"])}))
def test_listed_notebooks_are_committed_with_outputs(nb):
    cells = json.loads((ROOT / nb).read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    with_output = [c for c in code if c.get("outputs")]
    assert code and len(with_output) >= len(code) // 2, f"{nb}: {len(with_output)} of {len(code)} code cells have outputs"


def test_what_is_not_written_yet(capsys):
    gaps = [r["line"] for r in course_rows() if MISSING in r["line"]]
    for g in gaps:
        print("not written yet:", g)
    assert all(r["chapter"] or r["notebook"] for r in course_rows())


# --- issue 30: what the chapters say about the code, checked against the code ---------------------------------


def test_guided_requests_speculate_as_chapter_7b_and_the_readme_say(tmp_path):
    """Chapter 7b §7b.6 and the README say that guided requests speculate: run one with n-gram speculation
    and check the engine's drafted-token counter moved, and that both texts say so (and neither says not)."""
    pytest.importorskip("llguidance")
    from minfer import LLM, SamplingParams
    from minfer.sampling_params import GuidedDecodingParams

    from .test_structured_output import ENGINE, SCHEMA, save_char_tiny

    llm = LLM(model=save_char_tiny(tmp_path / "m"), **ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                  "prompt_lookup_min": 1})
    params = SamplingParams(temperature=0, max_tokens=100, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    out = llm.generate(['{"name": "ab", "age": 7} ' * 2], params)[0].outputs[0]
    assert out.finish_reason == "stop" and json.loads(out.text)["name"] is not None
    assert llm.stats().spec_decode_num_draft_tokens > 0, "a guided request with speculation drafted no token"
    chapter = re.sub(r"\s+", " ", (ROOT / "chapters/07-spec-decode.md").read_text())
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    assert "Guided requests (a JSON schema, a regex, a grammar) are the exception and do speculate" in chapter
    assert "guided requests do speculate" in readme
    for text in (chapter, readme):
        assert not re.search(r"(guided|grammar)[^.]{0,40}(do not|don't|never) speculate", text, re.I)
