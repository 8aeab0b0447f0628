"""`python -m minfer.course exercises|diagrams|words`: see minfer/course/__init__.py."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import DIAGRAMS, ROOT


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minfer.course")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("exercises", help="copy the notebooks with the exercises' solutions blanked")
    ex.add_argument("--out", type=Path, default=ROOT / "my-notebooks",
                    help="folder for the copies (default my-notebooks/ in the checkout, which git ignores)")
    ex.add_argument("--force", action="store_true", help="overwrite copies that exist (your answers in them are lost)")
    dg = sub.add_parser("diagrams", help="redraw the concept diagrams")
    dg.add_argument("--out", type=Path, default=DIAGRAMS, help=f"folder (default {DIAGRAMS})")
    wd = sub.add_parser("words", help="prose words and machine paragraphs of lessons")
    wd.add_argument("paths", nargs="*", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "exercises":
        from .notebook_tools import learner_copy

        if args.out.resolve() == (ROOT / "notebooks").resolve():
            ap.error("--out must not be notebooks/: the committed notebooks keep the solutions")
        total = 0
        for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
            try:
                n = learner_copy(nb, args.out / nb.name, force=args.force)
            except FileExistsError as e:
                print(f"skipped: {e}")
                continue
            total += n
            print(f"{args.out / nb.name}: {n} exercises blanked")
        print(f"{total} exercises; open them with: jupyter lab {args.out}")
    elif args.cmd == "diagrams":
        from .diagrams import draw_all

        for p in draw_all(args.out):
            print(p)
    else:
        from .text import report

        paths = args.paths or sorted((ROOT / "chapters").glob("*.md"))
        bad = [str(p) for p in paths if not p.is_file()]
        if bad:
            ap.error(f"not a lesson file: {', '.join(bad)}")
        print(report(paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
