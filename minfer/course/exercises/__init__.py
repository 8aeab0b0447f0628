"""Checks for the notebooks' exercises, one module per lesson (`ch04.py` for notebook 04, ...).

A notebook's exercise is a code cell tagged `exercise`: it imports what it needs and defines a function or a value,
with the solution between `### BEGIN SOLUTION` and `### END SOLUTION` (blanked by
`python -m minfer.course exercises`). The next cell, tagged `check`, calls a check from here, such as
`ch04.check_merge(merge)`, which compares the learner's answer against minfer on inputs it makes, prints
"... correct" or raises AssertionError saying what is off.

Each module defines `WRONG_ANSWERS`: for every check, a plausible wrong answer (the mistake a learner makes), so
`tests/test_lessons.py` shows each check failing on it.
"""
