"""Checks for the notebooks' exercises, one module per lesson (`ch04.py` for notebook 04, ...).

A notebook's exercise is a code cell tagged `exercise`: it imports what it needs and defines a function or a value,
with the solution between `### BEGIN SOLUTION` and `### END SOLUTION` (blanked by
`python -m minfer.course exercises`). The next cell, tagged `check`, calls a check from here, such as
`ch04.check_merge(merge)`, which compares the learner's answer against minfer on inputs it makes, prints
"... correct" or raises AssertionError saying what is off.

Each module defines `WRONG_ANSWERS`: for every check, a plausible wrong answer (the mistake a learner makes), so
`tests/test_lessons.py` shows each check failing on it.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable


def _label(fn: Callable) -> str:
    m = re.search(r"Exercise \w+\.\d+", fn.__doc__ or "")
    return m.group(0) if m else fn.__name__


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A check as the learner meets it: an exercise not yet written (its cell still raises NotImplementedError)
    prints "not attempted yet" instead of stopping "Run All"; any other error while checking the answer (a
    function that returns None, a wrong type) becomes an AssertionError that names the exercise."""

    @functools.wraps(fn)
    def check(*args: Any, **kwargs: Any) -> Any:
        label = _label(fn)
        try:
            return fn(*args, **kwargs)
        except NotImplementedError:
            print(f"{label}: not attempted yet. Write your code in the exercise cell above (it still raises "
                  "NotImplementedError), run it, then run this cell again.")
            return None
        except AssertionError:
            raise
        except Exception as e:
            raise AssertionError(f"{label}: checking your answer raised {type(e).__name__}: {e}. Does your code "
                                 "return what the exercise asks for (not None), with the right type?") from e

    return check


def guard_checks(namespace: dict[str, Any]) -> None:
    """Wrap every `check_*` function of a lesson's check module with `guarded` (each module ends with
    `guard_checks(globals())`)."""
    for name, obj in list(namespace.items()):
        if name.startswith("check_") and callable(obj):
            namespace[name] = guarded(obj)
