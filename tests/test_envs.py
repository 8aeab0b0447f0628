"""`minfer.envs`: every MINFER_* variable is named in that one module and read lazily; importing minfer sets
no environment variable; the OpenMP settings are made where a process that runs the model starts."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import minfer.envs as envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minfer"
ENVS = PACKAGE / "envs.py"
NAME = re.compile(r"MINFER_[A-Z0-9_]+")


def stray_names(text: str) -> list[str]:
    """MINFER_* names in a module's text that are not `envs.MINFER_X` reads (comments and docstrings included:
    they point a reader at `minfer.envs` the same way)."""
    return [m.group() for m in NAME.finditer(text) if not text[:m.start()].endswith("envs.")]


def package_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p != ENVS]


def test_minfer_variables_are_named_in_envs_only():
    stray = {str(p.relative_to(ROOT)): names for p in package_modules() if (names := stray_names(p.read_text()))}
    assert not stray, f"read these through minfer.envs (envs.MINFER_X): {stray}"


def test_the_rule_can_fail():
    probe = 'key = os.environ.get("MINFER_X")\n# `envs.MINFER_Y` is fine\ny = envs.MINFER_Y\n'
    assert stray_names(probe) == ["MINFER_X"]


def _table_source() -> tuple[str, str]:
    """(the ENVIRONMENT_VARIABLES table's source, the rest of envs.py)."""
    text = ENVS.read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ENVIRONMENT_VARIABLES":
            table = ast.get_source_segment(text, node)
            return table, text.replace(table, "")
    raise AssertionError("envs.py has no ENVIRONMENT_VARIABLES table")


def test_every_variable_is_documented_and_read():
    table, rest = _table_source()
    documented = set(envs.ENVIRONMENT_VARIABLES)
    for name, (getter, doc) in envs.ENVIRONMENT_VARIABLES.items():
        assert callable(getter) and doc.strip(), name
    mentioned = {m for p in package_modules() for m in NAME.findall(p.read_text())}
    assert mentioned <= documented, f"named in minfer/ but not in envs.ENVIRONMENT_VARIABLES: {mentioned - documented}"
    # read by another module (envs.MINFER_X), or set / read by envs's own functions
    unread = documented - mentioned - set(NAME.findall(rest))
    assert not unread, f"documented in minfer.envs but read nowhere: {sorted(unread)}"


def test_variables_are_read_when_asked_for(monkeypatch):
    monkeypatch.setenv("MINFER_DIST_TIMEOUT_S", "7.5")
    assert envs.MINFER_DIST_TIMEOUT_S == 7.5
    monkeypatch.setenv("MINFER_DIST_TIMEOUT_S", "9")
    assert envs.MINFER_DIST_TIMEOUT_S == 9.0
    monkeypatch.delenv("MINFER_DIST_TIMEOUT_S")
    assert envs.MINFER_DIST_TIMEOUT_S == 120.0
    for value, want in (("0", False), ("off", False), ("1", True), ("", True)):
        monkeypatch.setenv("MINFER_MALLOC_TUNING", value)
        assert envs.MINFER_MALLOC_TUNING is want, value
    with pytest.raises(AttributeError):
        envs.MINFER_NOT_A_VARIABLE  # noqa: B018 - the attribute access is the test


def test_linear_layouts_are_the_cpu_wings():
    from minfer.cpu.linear import LINEAR_METHODS

    assert envs.LINEAR_LAYOUTS == tuple(LINEAR_METHODS)


def test_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("MINFER_GGUF_ISA", "sse9")
    with pytest.raises(ValueError, match="MINFER_GGUF_ISA='sse9'"):
        envs.MINFER_GGUF_ISA  # noqa: B018
    monkeypatch.setenv("MINFER_DEVICE", "gpu0")
    with pytest.raises(ValueError, match="MINFER_DEVICE='gpu0' is not a device name"):
        envs.MINFER_DEVICE  # noqa: B018


def _clean_environ(monkeypatch):
    for k in envs.OMP_VARIABLES:
        monkeypatch.delenv(k, raising=False)


def test_configure_process_roles(monkeypatch):
    _clean_environ(monkeypatch)
    assert envs.configure_process("offline") == "GOMP_SPINCOUNT"
    assert os.environ["GOMP_SPINCOUNT"] == envs.OFFLINE_SPINCOUNT
    # a process started from this one (here: the same one, as a server) chooses again
    assert envs.configure_process("api_server") == "OMP_WAIT_POLICY"
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in os.environ
    assert envs.configure_process("engine_core") == "GOMP_SPINCOUNT"
    assert "OMP_WAIT_POLICY" not in os.environ and "MINFER_OMP_DEFAULT" not in os.environ
    want = envs.ENGINE_CORE_SPINCOUNT_NICED if os.getpriority(os.PRIO_PROCESS, 0) > 0 else envs.ENGINE_CORE_SPINCOUNT
    assert os.environ["GOMP_SPINCOUNT"] == want
    with pytest.raises(ValueError, match="role"):
        envs.configure_process("trainer")


def test_configure_process_keeps_the_users_choice(monkeypatch):
    _clean_environ(monkeypatch)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    for role in envs.PROCESS_ROLES:
        assert envs.configure_process(role) is None
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in os.environ


def _run(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in envs.OMP_VARIABLES and k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**environ, **env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)


def test_import_minfer_changes_no_environment_variable():
    r = _run("import os; before = dict(os.environ); import minfer; assert dict(os.environ) == before")
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_probe_catches_a_change():
    # the same probe fails when an import does change the environment
    r = _run("import os; before = dict(os.environ); os.environ['X_PROBE'] = '1'; assert dict(os.environ) == before")
    assert r.returncode != 0


def test_importing_the_server_package_elsewhere_changes_nothing():
    r = _run("import os; before = dict(os.environ); import minfer.serve; assert dict(os.environ) == before")
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_server_process_sets_its_policy_as_it_starts():
    # `python -m minfer.serve --help` runs the package's start-up, then prints the help and exits
    r = subprocess.run([sys.executable, "-c", "import sys, os; sys.argv = ['x', '--help']; "
                        "sys.orig_argv = [sys.executable, '-m', 'minfer.serve', '--help']; "
                        "import minfer.serve; print('POLICY', os.environ.get('OMP_WAIT_POLICY'))"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**{k: v for k, v in os.environ.items() if k not in envs.OMP_VARIABLES},
                            "PYTHONPATH": str(ROOT)})
    assert "POLICY PASSIVE" in r.stdout, r.stderr[-2000:]
    help_text = subprocess.run([sys.executable, "-m", "minfer.serve", "--help"], cwd=ROOT, capture_output=True,
                               text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert "OMP_WAIT_POLICY=PASSIVE" in help_text and "`import minfer` sets nothing" in help_text
    assert all(name in help_text for name in envs.ENVIRONMENT_VARIABLES)


def test_llm_sets_the_offline_policy_before_torch():
    # torch (which loads libgomp, which reads the variable) is not imported before `from minfer import LLM`
    r = _run("import os, sys; import minfer; loaded = 'torch' in sys.modules; from minfer import LLM; "
             "print(os.environ.get('GOMP_SPINCOUNT'), loaded, 'torch' in sys.modules)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [envs.OFFLINE_SPINCOUNT, "False", "True"]
