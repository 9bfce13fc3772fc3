"""The healing-text benchmark's own rules: how a run's healing text is named on the pages (so that a prompted run
never shares a row label with a run from the BOS token), the script rule that counts what a teacher wrote, and
the sampling seconds shown for rows read from a cache."""

from __future__ import annotations

import pytest


def test_each_healing_text_has_its_own_label():
    from benchmarks.recovery import protocol

    labels = {
        protocol.healing_text({}),
        protocol.healing_text({"teacher_text": 1.0}),
        protocol.healing_text({"teacher_text": 1.0, "teacher_prompts": True}),
        protocol.healing_text({"teacher_text": 0.5}),
        protocol.healing_text({"teacher_text": 0.5, "teacher_prompts": True}),
        protocol.healing_text({"teacher_text": 1.0, "sampling_start": "chat"}),
        protocol.healing_text({"teacher_text": 1.0, "guard_speeches": True}),
    }
    assert len(labels) == 7
    assert protocol.healing_text({}) == ""  # the speeches: the label older runs had
    assert protocol.healing_text({"teacher_text": 1.0, "teacher_prompts": False, "sampling_start": "bos"}) == (
        "the dense model's own text"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "It is manifest that these causes are daily losing their effect, and that these new States are settling.",
            "prose",
        ),
        ("def flatten(nested):\n    return [x for xs in nested for x in xs]  # {}[]", "code or markup"),
        ("<div class='a'>{{ value }}</div><br/>", "code or markup"),
        ("执行 Sql Script时，可以在脚本开始时连接到数据库进行插入操作", "CJK"),
        ("", "prose"),
    ],
)
def test_makeup_rule(text, expected):
    from benchmarks.recovery.teacher_text_makeup import kind

    assert kind(text) == expected


def test_makeup_counts_and_examples():
    from benchmarks.recovery.teacher_text_makeup import makeup

    texts = ["plain words here"] * 3 + ["{}();{}();"] * 2
    result = makeup(texts, examples=1)
    assert result["rows"] == 5
    assert result["counts"] == {"prose": 3, "code or markup": 2}
    assert result["examples"] == {"prose": ["plain words here"], "code or markup": ["{}();{}();"]}


def test_the_sampling_cell_says_what_cached_rows_cost_when_they_were_written():
    from benchmarks.render import sampling_cell

    assert sampling_cell({}) == ""
    assert sampling_cell({"cached": False, "seconds": 1506.7}) == "1507"
    assert sampling_cell({"cached": True, "seconds": 0.001}) == "cached"
    assert sampling_cell({"cached": True, "seconds": 0.001, "sampled": {"seconds": 1572.4}}) == "1572 (cached)"
