"""`python -m minfer.bench gemv` (minfer/bench/gemv.py) runs, reports every layout, and writes its JSON."""

import json
import math

from minfer.bench import best_time, gemv
from minfer.cpu.linear import onednn_available


def test_gemv_benchmark_reports_every_shape_and_layout(monkeypatch, tmp_path, capsys):
    # Small shapes, one of each orientation, so that the test takes a second rather than the real run's 20.
    monkeypatch.setattr(gemv, "SHAPES", {"wide": (32, 96), "narrow": (96, 32), "lm_head": (32, 64)})
    out = tmp_path / "gemv.json"
    assert gemv.main(["--json", str(out), "--rows", "1,3"]) == 0
    res = json.loads(out.read_text())
    assert set(res["shapes"]) == {"wide", "narrow", "lm_head"}
    keys = ["nn_linear_GBps", "longer_side_GBps", "split_GBps"] + (["onednn_GBps"] if onednn_available() else [])
    for name, row in res["shapes"].items():
        assert (row["in"], row["out"]) == gemv.SHAPES[name]
        for key in keys:
            assert math.isfinite(row[key]) and row[key] > 0, (name, key)
    assert list(res["rows"]) == ["1", "3"]
    for by in res["rows"].values():
        assert set(by) == {"nn", "split"} | ({"onednn"} if onednn_available() else set())
        assert all(math.isfinite(v) and v > 0 for v in by.values())
    printed = capsys.readouterr().out
    assert printed.startswith(f"{res['threads']} threads") and "wide" in printed and "96->32" in printed
    assert "GFLOP/s" in printed


def test_gemv_rejects_bad_rows(capsys):
    import pytest

    for bad in ("1,x", "0", str(gemv.MAX_ROWS + 1)):
        with pytest.raises(SystemExit):
            gemv.main(["--rows", bad])
        assert "--rows" in capsys.readouterr().err


def test_best_time_is_the_fastest_call():
    calls = []
    assert best_time(lambda: calls.append(1), repeats=3) >= 0
    assert len(calls) == 4  # one warm-up, then three timed calls
