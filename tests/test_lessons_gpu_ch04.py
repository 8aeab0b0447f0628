"""Lesson 04's guarded GPU section (`minfer.course.gpu.ch04`) runs on tiny shapes on a CPU, so it cannot rot
before a GPU runs it."""

from __future__ import annotations

from minfer.course.gpu import ch04


def test_gpu_section_runs_small_on_cpu():
    res = ch04.run("cpu", small=True)
    assert [r["seq_len"] for r in res["rows"]] == [16, 48]
    for r in res["rows"]:
        assert r["flash_ms"] > 0 and r["naive_ms"] > 0
        assert r["max_abs_err"] < 1e-4, r
    assert "naive" in ch04.table(res)


def test_naive_attention_matches_minfers_reference():
    import torch

    from minfer.kernels.reference import attention_reference

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(9, 4, 8, generator=g), torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    assert torch.allclose(ch04.naive_attention(q, k, v), attention_reference(q, k, v, causal=True), atol=1e-5)
