"""The course as a learner meets it (issue 39): short lessons with their logs in lab notes, concept diagrams,
interactive notebooks with checked exercises, traceable numbers, reading order with "next" links, and notebooks
that need only the base install and change no tracked file.

    pytest tests/test_lessons.py
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
import time
from pathlib import Path

import pytest
import tomllib

from minfer.course import notebook_tools as nbt
from minfer.course.numbers import problems
from minfer.course.text import machine_paragraphs, prose_words

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "chapters").glob("*.md"))
LABS = sorted((ROOT / "chapters" / "lab").glob("*.md"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MAX_WORDS, MAX_MACHINE_PARAGRAPHS, MAX_COURSE_WORDS = 3000, 3, 35000


def lesson_key(path: Path) -> tuple[int, str]:
    m = re.match(r"(\d+)([a-z]?)-", path.name)
    assert m, f"a lesson's file name starts with its number: {path.name}"
    return int(m.group(1)), m.group(2)


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.name)
def test_lesson_is_short_and_about_concepts(lesson):
    md = lesson.read_text()
    words = prose_words(md)
    machine = machine_paragraphs(md)
    assert words <= MAX_WORDS, f"{lesson.name}: {words} words of prose (at most {MAX_WORDS}; move logs to chapters/lab/)"
    assert len(machine) <= MAX_MACHINE_PARAGRAPHS, (
        f"{lesson.name}: {len(machine)} paragraphs name CPU models, load averages, JSON files or commits "
        f"(at most {MAX_MACHINE_PARAGRAPHS}): {[p[:80] for p in machine]}")


def test_the_course_is_short_and_has_lab_notes():
    total = sum(prose_words(p.read_text()) for p in LESSONS)
    assert total <= MAX_COURSE_WORDS, f"the lessons hold {total} words of prose (at most {MAX_COURSE_WORDS})"
    assert len(LABS) >= 5, f"only {len(LABS)} lab notes in chapters/lab/"


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.name)
def test_each_lab_note_is_linked_from_a_lesson(lab):
    linked = any(f"lab/{lab.name}" in p.read_text() for p in LESSONS) or lab.name == "README.md"
    assert linked, f"no lesson links chapters/lab/{lab.name}"


def test_lessons_are_numbered_in_reading_order_with_next_links():
    order = sorted(LESSONS, key=lesson_key)
    for cur, nxt in zip(order, order[1:]):
        links = re.findall(r"^\*?\*?Next\b.*?\]\(([^)]+)\)", cur.read_text(), re.M)
        assert links and links[-1] == nxt.name, f"{cur.name} should end with a 'Next:' link to {nxt.name}, has {links}"


DIAGRAM_LINK = re.compile(r"!\[[^\]]*\]\(\.\./assets/diagrams/([\w.-]+\.png)\)")


def test_concept_diagrams_are_drawn_by_code_and_embedded(tmp_path):
    from minfer.course.diagrams import draw_all, modules

    names = {m.NAME for m in modules()}
    embedded = {n[:-4] for p in LESSONS for n in DIAGRAM_LINK.findall(p.read_text())}
    assert len(embedded & names) >= 7, f"lessons embed {sorted(embedded & names)} of the drawn diagrams {sorted(names)}"
    assert embedded <= names, f"embedded diagrams that no module draws: {sorted(embedded - names)}"
    for n in names:
        assert (ROOT / "assets/diagrams" / f"{n}.png").is_file(), f"assets/diagrams/{n}.png is not committed"
    written = draw_all(tmp_path)
    assert all(p.stat().st_size > 5000 for p in written)


def _code(nb: Path) -> str:
    return "\n".join(nbt.source(c) for c in nbt.cells(nb) if c["cell_type"] == "code")


def test_at_least_ten_notebooks_have_an_interactive_control():
    with_widgets = [nb.name for nb in NOTEBOOKS if re.search(r"\bwidgets\.\w+\(|\binteract(ive)?\(", _code(nb))]
    assert len(with_widgets) >= 10, f"notebooks with an ipywidgets control: {with_widgets}"


def test_at_least_twelve_notebooks_have_two_checked_exercises():
    counts = {nb.name: len(nbt.exercises(nb)) for nb in NOTEBOOKS}
    enough = [n for n, k in counts.items() if k >= 2]
    assert len(enough) >= 12, f"exercises per notebook: {counts}"


EXERCISES = [(nb, i) for nb in NOTEBOOKS for i in range(len(nbt.exercises(nb)))]


@pytest.mark.parametrize("nb,i", EXERCISES, ids=[f"{nb.stem}-{i}" for nb, i in EXERCISES])
def test_exercise_solution_passes_and_blank_fails(nb, i, capsys):
    """The committed solution passes its check; the learner's blank copy does not pass: its check says "not
    attempted yet" (so "Run All" goes on to the rest of the notebook) and never "correct"."""
    ex, check = nbt.exercises(nb)[i]
    assert check is not None and "check" in nbt.tags(check), f"{nb.name}: exercise {i} has no cell tagged 'check' after it"
    check_src = nbt.source(check)
    assert "minfer.course.exercises" in check_src or "exercises import" in check_src, check_src
    ns: dict = {}
    exec(compile(nbt.source(ex), f"{nb.name}[exercise {i}]", "exec"), ns)
    exec(compile(check_src, f"{nb.name}[check {i}]", "exec"), ns)
    assert "correct" in capsys.readouterr().out
    ns = {}
    exec(compile(nbt.blank(nbt.source(ex)), f"{nb.name}[blank {i}]", "exec"), ns)
    exec(compile(check_src, f"{nb.name}[check {i}]", "exec"), ns)
    out = capsys.readouterr().out
    assert "not attempted yet" in out and "correct" not in out, out


def _exercise_modules():
    import pkgutil

    import minfer.course.exercises as pkg

    return [importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]


@pytest.mark.parametrize("mod", _exercise_modules(), ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_every_check_fails_on_a_wrong_answer(mod):
    checks = {n for n in dir(mod) if n.startswith("check_")}
    wrong = getattr(mod, "WRONG_ANSWERS", {})
    assert checks and set(wrong) == checks, f"{mod.__name__}: WRONG_ANSWERS must give a wrong answer for {sorted(checks)}"
    for name, answer in wrong.items():
        with pytest.raises(AssertionError):
            getattr(mod, name)(answer)
        # an answer that forgot its `return` fails with a message that names the exercise, not a TypeError
        with pytest.raises(AssertionError):
            getattr(mod, name)(_returns_none)


def _returns_none(*args, **kwargs):
    return None


def test_learner_copies_blank_every_solution_and_keep_a_learners_work(tmp_path, capsys):
    from minfer.course.__main__ import main

    assert main(["exercises", "--out", str(tmp_path)]) == 0
    copies = sorted(tmp_path.glob("*.ipynb"))
    assert len(copies) == len(NOTEBOOKS)
    for nb in copies:
        text = nb.read_text()
        assert nbt.BEGIN not in text and '"outputs": []' in text or not nbt.exercises(nb)
    copies[0].write_text(copies[0].read_text() + " ")  # the learner's answers
    assert main(["exercises", "--out", str(tmp_path)]) == 0
    assert copies[0].read_text().endswith(" "), "a second run overwrote the learner's copy"
    assert "skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["exercises", "--out", str(ROOT / "notebooks")])


def test_blank_refuses_unmatched_markers():
    with pytest.raises(ValueError):
        nbt.blank(f"def f():\n    {nbt.BEGIN}\n    return 1\n")
    with pytest.raises(ValueError):
        nbt.blank(f"def f():\n    {nbt.BEGIN}\n    {nbt.BEGIN}\n    return 1\n    {nbt.END}\n")


def _base_dependencies() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~\[; ]", d, 1)[0].lower().replace("-", "_") for d in deps}


IMPORT_NAMES = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit_learn", "IPython": "ipython",
                "huggingface_hub": "huggingface_hub", "google": "protobuf"}
INSTALLED_WITH = {"ipython": "ipywidgets", "pillow": "matplotlib", "jinja2": "transformers"}


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_imports_only_base_dependencies(nb):
    base = _base_dependencies()
    missing = set()
    for cell in nbt.cells(nb):
        if cell["cell_type"] != "code":
            continue
        src = "\n".join(line for line in nbt.source(cell).splitlines() if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(src)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("minfer", "tests", "benchmarks"):
                    continue
                dist = IMPORT_NAMES.get(top, top).lower().replace("-", "_")
                if dist not in base and INSTALLED_WITH.get(dist) not in base:
                    missing.add(top)
    assert not missing, f"{nb.name} imports {sorted(missing)}, which the base install (pyproject's dependencies) lacks"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_writes_no_tracked_file(nb):
    """Running a notebook changes no tracked file: figures go through minfer.course.save_figure, which writes only
    when MINFER_SAVE_FIGURES=1."""
    code = _code(nb)
    assert not re.search(r"\.savefig\(", code), f"{nb.name} calls savefig directly; use minfer.course.save_figure"
    assert not re.search(r"(write_text|write_bytes|json\.dump)\([^)]*(assets|notebooks|chapters)", code), nb.name


def test_save_figure_writes_only_when_asked(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import minfer.course as course

    monkeypatch.setattr(course, "FIGURES", tmp_path)
    fig = plt.figure()
    monkeypatch.delenv("MINFER_SAVE_FIGURES", raising=False)
    assert course.save_figure(fig, "x.png") is None and not (tmp_path / "x.png").exists()
    monkeypatch.setenv("MINFER_SAVE_FIGURES", "1")
    assert course.save_figure(fig, "x.png") == tmp_path / "x.png" and (tmp_path / "x.png").is_file()
    plt.close(fig)


def test_machine_note_warns_when_busy(monkeypatch, capsys):
    import os

    import minfer.course as course

    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(course, "other_cpu_use", lambda: 1.7)
    assert course.machine()["busy"]
    assert "WARNING" in capsys.readouterr().out
    # this notebook's own last minute raises the load average; what counts is what others use now
    monkeypatch.setattr(os, "getloadavg", lambda: (2.2, 2.2, 2.2))
    monkeypatch.setattr(course, "other_cpu_use", lambda: 0.1)
    assert not course.machine()["busy"]
    assert "WARNING" not in capsys.readouterr().out
    monkeypatch.setattr(course, "other_cpu_use", lambda: None)  # no /proc: the load average decides
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    assert course.machine()["busy"]


def test_other_cpu_use_sees_a_busy_process():
    """A process spinning beside this one shows up as about one busy core; this process's own work does not."""
    import subprocess

    import minfer.course as course

    if course.other_cpu_use() is None:
        pytest.skip("no /proc/stat here")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        assert course.other_cpu_use(window_s=0.5) > 0.5
    finally:
        spin.kill()


def test_readme_is_the_front_door():
    """What minfer is comes first (≤ 120 words after the two commands), the whole README stays ≤ 2,000 words,
    and its quoted results match their JSONs."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text.split("\n## ", 1)[0], re.S)
    assert len(blocks) == 2 and "scripts/setup.sh &&" in blocks[0] and "setup.sh --test &&" in blocks[1], blocks
    first = re.sub(r"^(```).*?^\1", "", text.split("\n## ", 1)[0], flags=re.S | re.M)
    paragraph = next(p for p in re.split(r"\n\s*\n", first) if p.strip() and not p.startswith("#"))
    assert "inference engine" in paragraph and len(paragraph.split()) <= 120, paragraph
    assert len(text.split()) <= 2000, f"the README has {len(text.split())} words"
    assert problems(ROOT / "README.md") == []


def test_the_package_imports_from_the_folder_that_holds_a_checkout_named_minfer(tmp_path):
    """A learner who cloned into `minfer/` and runs Python beside it gets the package, not the folder (the
    README's snippets work from any folder): scripts/setup.sh installs in compat editable mode."""
    import subprocess

    (tmp_path / "minfer").symlink_to(ROOT)
    r = subprocess.run([sys.executable, "-c", "from minfer import LLM, SamplingParams; print('ok')"], cwd=tmp_path,
                       capture_output=True, text=True, env={k: v for k, v in __import__("os").environ.items()
                                                            if k != "PYTHONPATH"})
    assert r.stdout.strip() == "ok", r.stderr[-500:]
