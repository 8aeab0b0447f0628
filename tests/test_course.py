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

from minfer.course.numbers import problems

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
        assert len(cells) == 6, f"a course row needs 6 columns (§, lesson, notebook, modules, lab notes, tests): {line}"
        sections, chapter, notebook, modules, lab, tests = cells
        rows.append({"sections": [int(s) for s in re.findall(r"\d+", sections)], "chapter": chapter,
                     "notebook": notebook, "modules": modules, "lab": lab, "tests": tests, "line": line})
    return rows


def test_every_section_has_a_row_and_rows_follow_the_lessons_order():
    """Every § of the article has a lesson, and the course map lists the lessons in reading order, which is the
    order of their numbers (00, 01, 02, 03, 03b, 04, ...), and lists every lesson."""
    rows = course_rows()
    covered = {s for r in rows for s in r["sections"]}
    assert covered == SECTIONS, f"sections without a row: {sorted(SECTIONS - covered)}"
    files = [re.findall(r"\]\(chapters/([^)]+)\)", r["chapter"])[0] for r in rows]
    key = lambda f: (int(re.match(r"\d+", f).group(0)), f)  # noqa: E731
    assert files == sorted(files, key=key), f"rows are not in the lessons' order: {files}"
    assert set(files) == {p.name for p in (ROOT / "chapters").glob("*.md")}, "the course map must list every lesson"


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
        for link in re.findall(r"\]\(([^)]+)\)", r["lab"]):
            if not (ROOT / link).is_file():
                problems.append(f"lab notes {link}")
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
    chapter = re.sub(r"\s+", " ", (ROOT / "chapters/07b-spec-decode.md").read_text())
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    assert "Guided requests (a JSON schema, a regex, a grammar) are the exception and do speculate" in chapter
    assert "guided requests do speculate" in readme
    for text in (chapter, readme):
        assert not re.search(r"(guided|grammar)[^.]{0,40}(do not|don't|never) speculate", text, re.I)


VERDICTS = {"vLLM's": "accepted", "vLLM's flag, other value": "value refused", "not a vLLM flag": "unknown"}


def _verdict_of(row: dict) -> str:
    """The verdict a row of `assets/benchmarks/vllm_flags.json` earns (benchmarks/vllm_flags.py)."""
    v = row["vllm"]
    return "vLLM's" if v["accepted"] else ("vLLM's flag, other value" if v["known"] else "not a vLLM flag")


def test_every_flag_of_the_articles_command_is_in_chapter_9s_table_with_its_verdict():
    """Chapter 9 §9.4's table has a row for each flag of the article's §16 command (read from the article when
    ../shared/seed has it, else from the committed JSON), with the verdict vLLM's own parser gave it
    (`assets/benchmarks/vllm_flags.json`, written by `benchmarks/vllm_flags.py`)."""
    data = json.loads((ROOT / "assets/benchmarks/vllm_flags.json").read_text())
    flags = [r["flag"] for r in data["article_command"]]
    article = ROOT.parent / "shared" / "seed" / "llm-inference-a-to-z.ko.txt"
    if article.is_file():
        from tests.benchmark_scripts import load_benchmark

        mod = load_benchmark("vllm_flags")
        assert [f for f, _ in mod.article_command_from_text(article.read_text(encoding="utf-8"))] == flags
    assert len(flags) == 20 and len(set(flags)) == 20
    text = (ROOT / "chapters/09-serving.md").read_text()
    section = text.split("## 9.4 ", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `--") else []
        if len(cells) >= 4:
            m = re.match(r"`(--[a-z0-9-]+)", cells[0])
            if m and cells[2] in VERDICTS:
                rows[m.group(1)] = cells[2]
    by_flag = {r["flag"]: r for r in data["flags"]}
    missing = [f for f in flags if f not in rows]
    assert not missing, f"flags of the article's command without a row and a verdict in §9.4: {missing}"
    wrong = {f: (rows[f], _verdict_of(by_flag[f])) for f in flags if rows[f] != _verdict_of(by_flag[f])}
    assert not wrong, f"§9.4's verdicts differ from vLLM's parser (table, JSON): {wrong}"


def test_every_figure_a_chapter_embeds_is_committed():
    """A chapter read on the web, without Jupyter, shows its notebook's key figure: each `![...](path)` in a
    chapter names a file that exists (the notebooks save them under assets/figures/)."""
    missing = []
    for ch in sorted((ROOT / "chapters").glob("*.md")):
        for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", ch.read_text()):
            if not (ch.parent / link).resolve().is_file():
                missing.append(f"{ch.name}: {link}")
    assert not missing, f"embedded figures that do not exist: {missing}"


def figures_saved_by_notebooks() -> set[str]:
    """The file names under assets/figures/ that some notebook's code cell writes (`save_figure(fig, NAME)`)."""
    saved = set()
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "code":
                src = "".join(cell["source"])
                saved |= set(re.findall(r"assets/figures/([\w.-]+\.png)", src))
                saved |= set(re.findall(r"save_figure\([^,]+,\s*[\"']([\w.-]+\.png)", src))
    return saved


@pytest.mark.parametrize("chapter", sorted((ROOT / "chapters").glob("*.md")), ids=lambda ch: ch.name)
def test_every_chapter_embeds_a_figure_its_notebook_saves(chapter):
    """A reader of the chapters alone (on the web, without Jupyter) sees at least one plot per chapter: the chapter
    embeds `![...](../assets/figures/NAME.png)`, the file is committed, and a notebook's cell writes it, so the
    figure is redrawn with the data whenever the notebook runs."""
    saved = figures_saved_by_notebooks()
    links = re.findall(r"!\[[^\]]*\]\(\.\./assets/figures/([^)]+)\)", chapter.read_text())
    good = [name for name in links if name in saved and (ROOT / "assets/figures" / name).is_file()]
    assert good, (f"{chapter.name} embeds no figure from assets/figures/ that a notebook saves "
                  f"(embeds {links}; notebooks save {sorted(saved)})")


def test_serve_help_marks_the_articles_spellings_that_vllm_refuses():
    """minfer accepts every flag of the article's command, and its --help says at each one vLLM's parser refused
    (`assets/benchmarks/vllm_flags.json`) that the spelling or value is the article's."""
    from minfer.serve.__main__ import build_parser

    data = json.loads((ROOT / "assets/benchmarks/vllm_flags.json").read_text())
    parser = build_parser()
    for row in data["flags"]:
        argv = [row["flag"]] + ([row["value"]] if row["value"] is not None else [])
        parser.parse_args(argv)  # accepted (argparse exits otherwise)
        if not row["vllm"]["accepted"]:
            help_text = re.sub(r"\s+", " ", parser._option_string_actions[row["flag"]].help)
            assert "article" in help_text and "vLLM" in help_text, (row["flag"], help_text)


EAGER_ROWS = {"default": "default", "`--enforce-eager`": "eager", "`--kernels reference`": "reference"}
EAGER_COLUMNS = [("startup_health_s", 1), ("startup_first_completion_s", 1), ("short_ttft_p50_ms", 0),
                 ("long_ttft_p50_ms", 0), ("short_tpot_p50_ms", 1)]


def test_chapter_15s_enforce_eager_table_is_its_json():
    """Chapter 15 §15.8's table (start-up, TTFT, TPOT with and without `--enforce-eager`) shows, row by row, the
    medians of `assets/benchmarks/enforce_eager_cpu.json` (benchmarks/enforce_eager.py), rounded as printed, and
    that run was timed under the benchmark lock with its load average recorded."""
    data = json.loads((ROOT / "assets/benchmarks/enforce_eager_cpu.json").read_text())
    assert data["command"].startswith("flock /tmp/minfer-bench.lock") and len(data["load_average"]["before"]) == 3
    section = (ROOT / "chapters/15-operations.md").read_text().split("## 15.8 ", 1)[1].split("\n## ", 1)[0]
    seen = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or cells[0] not in EAGER_ROWS:
            continue
        mode = EAGER_ROWS[cells[0]]
        numbers = [float(re.sub(r"[^\d.]", "", c)) for c in cells[1:1 + len(EAGER_COLUMNS)]]
        want = [round(data["summary"][mode][key], digits) for key, digits in EAGER_COLUMNS]
        assert numbers == want, f"§15.8's {cells[0]} row {numbers} != the JSON's {want}"
        seen.add(mode)
    assert seen == set(EAGER_ROWS.values()), f"§15.8's table lacks rows for {set(EAGER_ROWS.values()) - seen}"


def test_enforce_eager_help_says_what_it_does_on_cpu_and_gpu():
    from minfer.serve.__main__ import build_parser

    help_text = re.sub(r"\s+", " ", build_parser()._option_string_actions["--enforce-eager"].help)
    assert "CPU" in help_text and "CUDA" in help_text and "decode step" in help_text and "graph" in help_text


# --- issue 39: every number a lesson quotes is checked against the JSON or notebook output it links to ---------

LESSONS = sorted((ROOT / "chapters").glob("*.md"))
LABS = sorted((ROOT / "chapters" / "lab").glob("*.md"))


@pytest.mark.parametrize("lesson", LESSONS + LABS, ids=lambda p: p.parent.name + "/" + p.name)
def test_quoted_numbers_match_their_sources(lesson):
    bad = problems(lesson)
    assert not bad, f"{lesson.name}:\n" + "\n".join(bad)


def test_a_wrong_quoted_number_fails(tmp_path):
    """The numbers check can fail: a lesson quoting a JSON value or a notebook output wrongly is caught."""
    (tmp_path / "r.json").write_text(json.dumps({"runs": [{"ttft_ms": 498.04, "a": 3.0, "b": 2.0}]}))
    (tmp_path / "n.ipynb").write_text(json.dumps({"cells": [{"cell_type": "code", "source": "", "outputs": [
        {"output_type": "stream", "name": "stdout", "text": "offline engine: 4997 ms\n"}]}]}))
    good = tmp_path / "good.md"
    good.write_text("TTFT was [498 ms](r.json#/runs/0/ttft_ms), a [1.5×](r.json#/runs/0/a:/runs/0/b) gain, "
                    "and [4,997 ms](n.ipynb) offline.\n")
    assert problems(good) == []
    bad = tmp_path / "bad.md"
    bad.write_text("TTFT was [123 ms](r.json#/runs/0/ttft_ms) and [101 s](n.ipynb); decode took 43.4 ms.\n")
    found = problems(bad)
    assert len(found) == 3, found
    (tmp_path / "s.json").write_text(json.dumps({"delta": -0.0008, "tiny": 0.00009}))
    (tmp_path / "m.ipynb").write_text(json.dumps({"cells": [{"cell_type": "code", "source": "", "outputs": [
        {"output_type": "stream", "name": "stdout", "text": "ratio 4.57\n"}]}]}))
    sly = tmp_path / "sly.md"
    sly.write_text("A [0.08%](s.json#/delta) change, a [0.00](s.json#/tiny) gap, [4](m.ipynb) blocks, "
                   "a [1.5×](s.json#/delta:/missing) ratio.\n")
    assert len(problems(sly)) == 4, problems(sly)  # sign flipped, 1/1000 to zero, a decimal's prefix, no key


def test_every_relative_link_of_the_lessons_exists():
    missing = []
    for md in LESSONS + LABS:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", md.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")) and not (md.parent / target).exists():
                missing.append(f"{md.relative_to(ROOT)}: {target}")
    assert not missing, missing
