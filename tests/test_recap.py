"""The recap quiz (article §17): every answer is what minfer measures (`minfer/recap.py`).

    pytest tests/test_recap.py
"""

from __future__ import annotations

import pytest

from minfer import recap


@pytest.fixture(scope="module")
def ctx():
    from minfer import LLM

    return recap.RecapContext(LLM(max_model_len=4096))


@pytest.mark.parametrize("question", recap.QUESTIONS, ids=lambda q: q.key)
def test_each_check_supports_the_articles_answer(ctx, question):
    evidence = question.check(ctx)
    assert evidence.lines, "a check must show what it measured"
    assert evidence.supports == question.answer, "\n".join(evidence.lines)


def test_ten_questions_with_well_formed_options():
    assert len(recap.QUESTIONS) == 10  # the article's ten confusions
    assert len({q.key for q in recap.QUESTIONS}) == 10
    for q in recap.QUESTIONS:
        assert 0 <= q.answer < len(q.options) and len(q.options) >= 2


def test_a_check_can_disagree(ctx, monkeypatch):
    """Were the engine's length rule off by one, the max_model_len check would no longer support 1096."""
    import minfer.sequence as sequence

    real = sequence.validate_prompt

    def off_by_one(ids, params, max_model_len, vocab):
        return real(ids, params, max_model_len + 1, vocab)

    monkeypatch.setattr(sequence, "validate_prompt", off_by_one)
    assert recap.check_max_model_len(ctx).supports != 1


def test_pipeline_bubble_fraction():
    assert recap.pipeline_bubble_fraction(1, 1) == 0
    assert recap.pipeline_bubble_fraction(4, 1) == pytest.approx(0.75)
    assert recap.pipeline_bubble_fraction(4, 29) == pytest.approx(3 / 32)
    with pytest.raises(ValueError):
        recap.pipeline_bubble_fraction(0, 4)
