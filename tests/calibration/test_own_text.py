"""The model's own text in the calibration (`CalibrationConfig.own_text`, `recovery.own_calibration`): the rows it
writes take the place of a share of the drawn windows, the same seed gives the same calibration, a resumable job
keeps them, and what cannot write text is refused before any weight changes; through `FlattenQuantizer` and the CLI.
"""

from __future__ import annotations

import json

import pytest
import torch

import tiny_models
from common import TINY_CALIBRATION, compress, one_error_line, tiny_config
from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.calibration.data import build_calibration_batches
from optimum_flatten.calibration.tokens import token_stream
from optimum_flatten.cli.main import main
from optimum_flatten.options import CalibrationConfig
from optimum_flatten.recovery.own_calibration import own_row_count, sample_own_rows
from optimum_flatten.recovery.teacher_text import sample_teacher_rows
from optimum_flatten.utils.fingerprint import weights_fingerprint

TOKENIZER = tiny_models.CharTokenizer()


def _config(**options) -> CalibrationConfig:
    return CalibrationConfig(dataset=tiny_models.sample_texts(), **{**TINY_CALIBRATION, **options})


def _rows(batches) -> list[torch.Tensor]:
    return [row for batch in batches for row in batch.input_ids]


def _windows(config: CalibrationConfig) -> set[tuple[int, ...]]:
    """Every packed window of the dataset's token stream (what a drawn row must be one of)."""
    stream = token_stream(TOKENIZER, tiny_models.sample_texts()).tolist()
    n = len(stream) // config.seqlen
    return {tuple(stream[i * config.seqlen : (i + 1) * config.seqlen]) for i in range(n)}


@pytest.mark.parametrize(("share", "own"), [(0.5, 4), (0.01, 1), (0.99, 7), (0.3, 2)])
def test_the_share_is_a_count_of_rows_and_leaves_the_dataset_at_least_one(share, own):
    assert own_row_count(_config(own_text=share)) == own


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"own_text": 1.0}, r"in \[0, 1\)"),
        ({"own_text": -0.1}, r"in \[0, 1\)"),
        ({"own_text": 0.5, "nsamples": 1}, "nsamples >= 2"),
    ],
)
def test_a_share_out_of_range_is_refused_by_the_options(options, message):
    with pytest.raises(ValueError, match=message):
        _config(**options)


def test_own_rows_replace_that_many_drawn_windows_in_a_seeded_order():
    config = _config(own_text=0.5)
    own = torch.randint(3, 30, (4, config.seqlen), generator=torch.Generator().manual_seed(0))
    rows = _rows(build_calibration_batches(TOKENIZER, config, own))
    assert len(rows) == config.nsamples
    own_set = {tuple(r.tolist()) for r in own}
    mine = [tuple(r.tolist()) for r in rows if tuple(r.tolist()) in own_set]
    drawn = [tuple(r.tolist()) for r in rows if tuple(r.tolist()) not in own_set]
    assert sorted(mine) == sorted(own_set) and len(drawn) == 4
    assert set(drawn) <= _windows(config)  # the rest are windows of the dataset, as without own rows
    again = _rows(build_calibration_batches(TOKENIZER, config, own))
    assert all(torch.equal(a, b) for a, b in zip(rows, again, strict=True))
    # Shuffled, not appended: the last batch (a method's held-out batch) is not the own rows alone.
    assert [tuple(r.tolist()) in own_set for r in rows] != [False] * 4 + [True] * 4


def test_own_rows_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match=r"seqlen=24"):
        build_calibration_batches(TOKENIZER, _config(own_text=0.5), torch.zeros(4, 23, dtype=torch.long))


def test_the_model_writes_seqlen_tokens_after_its_start_token_which_is_dropped():
    model, config = tiny_models.tiny_llama_gqa(), _config(own_text=0.5)
    ids, record = sample_own_rows(model, TOKENIZER, config, progress=False)
    # The naive reference: the healing's sampler on the calibration's stream and seed, one token longer, BOS cut.
    rows, _ = sample_teacher_rows(model, TOKENIZER, 4, config.seqlen + 1, seed=config.seed, stream="calibration",
                                  progress=False)  # fmt: skip
    assert torch.equal(ids, torch.stack([r["input_ids"][1:] for r in rows]))
    assert ids.shape == (4, config.seqlen) and record["share"] == 0.5 and record["rows"] == 4
    assert not (ids == TOKENIZER.bos_token_id).all(dim=1).any()
    other, _ = sample_own_rows(model, TOKENIZER, _config(own_text=0.5, seed=1), progress=False)
    assert not torch.equal(ids, other)  # the calibration's seed draws the rows too


def test_compress_calibrates_on_the_models_rows_and_reports_them():
    model = tiny_models.tiny_llama_gqa()
    own, _ = sample_own_rows(tiny_models.tiny_llama_gqa(), TOKENIZER, _config(own_text=0.5), progress=False)
    quantizer = FlattenQuantizer(tiny_config("shortgpt", num_layers_to_remove=1, own_text=0.5))
    checked = quantizer.preflight(model, TOKENIZER)
    expected = build_calibration_batches(TOKENIZER, quantizer.config.calibration, own)
    assert all(torch.equal(a, b) for a, b in zip(_rows(checked.batches), _rows(expected), strict=True))
    entry = compress(model, quantizer.config).report.to_dict()["calibration"]["own_text"]
    assert entry["share"] == 0.5 and entry["rows"] == 4 and entry["cached"] is False


def test_without_own_text_the_calibration_is_what_it_was():
    config = _config()
    assert config.own_text == 0.0
    plain = _rows(build_calibration_batches(TOKENIZER, config))
    assert set(tuple(r.tolist()) for r in plain) <= _windows(config) and len(plain) == config.nsamples


def test_a_resumable_job_keeps_the_rows_and_reads_them_back(tmp_path):
    config = tiny_config("flattengpt", num_layers_to_remove=1, own_text=0.5, resume_dir=str(tmp_path / "state"))
    first = FlattenQuantizer(config)
    first.compress(tiny_models.tiny_llama_gqa(), TOKENIZER)
    assert (tmp_path / "state" / "own_text").is_dir()
    again = FlattenQuantizer(config)
    checked = again.preflight(tiny_models.tiny_llama_gqa(), TOKENIZER)
    assert checked.own_text["cached"] is True
    assert first.report.to_dict()["calibration"]["own_text"]["cached"] is False


def test_a_model_that_writes_no_text_is_refused_before_any_weight_changes():
    model = tiny_models.tiny_bert()
    before = weights_fingerprint(model)
    config = FlattenConfig(method="shortgpt", num_layers_to_remove=1, dataset=tiny_models.sample_texts(),
                           own_text=0.5, **TINY_CALIBRATION)  # fmt: skip
    with pytest.raises(ValueError, match="needs a model that writes text"):
        FlattenQuantizer(config).compress(model, TOKENIZER)
    assert weights_fingerprint(model) == before


def test_the_command_line_flag_reaches_the_saved_report(tmp_path, capsys):
    dense, text = tmp_path / "dense", tmp_path / "text.txt"
    tiny_models.tiny_llama_gqa().save_pretrained(dense)
    tiny_models.tiny_hf_tokenizer().save_pretrained(dense)
    text.write_text("\n".join(tiny_models.sample_texts(60)))
    out = tmp_path / "out"
    code = main(["compress", str(dense), "--method", "shortgpt", "--num-layers-to-remove", "1", "--dataset", str(text),
                 "--nsamples", "4", "--seqlen", "32", "--own-text", "0.5", "--output", str(out)])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    report = json.loads((out / "flatten_report.json").read_text())
    assert report["calibration"]["own_text"]["rows"] == 2 and report["calibration"]["nsamples"] == 4
    # What the model wrote, for a person to judge: the summary's row, its first row's opening and its repetition.
    assert "the model's own sequences" in printed.out and "2 of 4, sampled in" in printed.out
    excerpt = report["calibration"]["own_text"]["excerpts"][0][:160]
    assert f"the model's own calibration text began: {excerpt!r}" in printed.out
    assert "the model's own calibration text: " in printed.out and "-grams repeat one before them" in printed.out
    code = main(["compress", str(dense), "--method", "shortgpt", "--num-layers-to-remove", "1", "--dataset", str(text),
                 "--own-text", "1", "--output", str(tmp_path / "o2")])  # fmt: skip
    assert code == 2 and "own_text" in one_error_line(capsys) and not (tmp_path / "o2").exists()


# ------------------------------------------------------------------------------------------------------------------
# What a review of the doors found (2026-12-07): each test failed before its fix.


@pytest.mark.parametrize(("nsamples", "share", "own"), [(2, 0.5, 1), (8, 0.9, 7), (4, 0.7, 3)])
def test_one_row_left_to_the_dataset_is_drawn_not_refused(nsamples, share, own):
    """Drawing the dataset's share re-checked the options with the share still set, so `nsamples - own == 1` was
    refused as "nsamples >= 2 ... got 1", after the model had written its rows."""
    config = _config(nsamples=nsamples, own_text=share)
    rows = torch.randint(3, 30, (own, config.seqlen), generator=torch.Generator().manual_seed(0))
    assert len(_rows(build_calibration_batches(TOKENIZER, config, rows))) == nsamples


def _no_sampling(monkeypatch) -> None:
    """Fails the test if the model is asked to write its rows (its generation, past the sampler's own checks)."""
    from optimum_flatten.recovery import teacher_text

    def refuse(*args, **kwargs):
        raise AssertionError("the model sampled its rows before the refusal")

    monkeypatch.setattr(teacher_text, "_continue", refuse)


def test_too_little_text_is_refused_before_the_model_writes_and_says_the_datasets_share(monkeypatch):
    _no_sampling(monkeypatch)
    model = tiny_models.tiny_llama_gqa()
    config = tiny_config("shortgpt", num_layers_to_remove=1, own_text=0.5, dataset=["the state of the union"])
    with pytest.raises(ValueError, match=r"own_text=0.5: the model writes 4 of the nsamples=8 rows, the dataset"):
        FlattenQuantizer(config).compress(model, TOKENIZER)


def test_an_encoder_decoder_model_is_refused_before_any_weight_changes():
    model = tiny_models.tiny_marian()
    before = weights_fingerprint(model)
    config = tiny_config("shortgpt", num_layers_to_remove=1, own_text=0.5, stacks=["decoder"])
    with pytest.raises(ValueError, match="MarianMTModel is an encoder-decoder model"):
        FlattenQuantizer(config).compress(model, TOKENIZER)
    assert weights_fingerprint(model) == before


@pytest.mark.parametrize("folder", ["a file", "another job's files"])
def test_a_resume_dir_that_cannot_hold_the_job_is_refused_before_the_model_writes(tmp_path, monkeypatch, folder):
    _no_sampling(monkeypatch)
    state = tmp_path / "state"
    if folder == "a file":
        state.write_text("not a folder")
        message = "is a file; give a folder"
    else:
        state.mkdir()
        (state / "notes.txt").write_text("mine")
        message = "it is no compression's state"
    config = tiny_config("flattengpt", num_layers_to_remove=1, own_text=0.5, resume_dir=str(state))
    with pytest.raises(ValueError, match=message):
        FlattenQuantizer(config).compress(tiny_models.tiny_llama_gqa(), TOKENIZER)
    assert folder == "a file" or sorted(p.name for p in state.iterdir()) == ["notes.txt"]  # nothing written there


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"own_text": 0.25}, r"holds the state of another job \(its options differs from this run's: own_text: 0.5"),
        # The rows' seed and length are the calibration's, compared on its batches only once the rows exist: the
        # kept rows' own key refuses them first, instead of sampling over the rows the job needs.
        ({"seed": 1}, r"holds the calibration rows another job sampled \(seed: 0 then, 1 now\)"),
        (
            {"seqlen": 16},
            r"holds the calibration rows another job sampled \(seqlen: 24 then, 16 now\)",
        ),
    ],
)
def test_resuming_with_other_rows_is_refused_and_leaves_the_kept_rows_as_they_were(
    tmp_path, monkeypatch, changed, message
):
    state = tmp_path / "state"
    first = tiny_config("flattengpt", num_layers_to_remove=1, own_text=0.5, resume_dir=str(state))
    FlattenQuantizer(first).compress(tiny_models.tiny_llama_gqa(), TOKENIZER)
    kept = {p.name: p.read_bytes() for p in (state / "own_text").iterdir()}
    _no_sampling(monkeypatch)
    other = tiny_config("flattengpt", num_layers_to_remove=1, resume_dir=str(state), **{"own_text": 0.5, **changed})
    with pytest.raises(ValueError, match=message):
        FlattenQuantizer(other).compress(tiny_models.tiny_llama_gqa(), TOKENIZER)
    assert {p.name: p.read_bytes() for p in (state / "own_text").iterdir()} == kept


def test_a_tokenizer_with_no_start_token_is_refused_in_the_options_words():
    from optimum_flatten.recovery.own_calibration import check_own_text
    from optimum_flatten.utils.errors import CalibrationDataError

    class NoStart(tiny_models.CharTokenizer):
        bos_token_id = None
        eos_token_id = None

    with pytest.raises(CalibrationDataError, match=r"own_text=0.5 samples rows from the tokenizer's start token"):
        check_own_text(tiny_models.tiny_llama_gqa(), NoStart(), _config(own_text=0.5))


def test_the_summary_of_rows_read_back_gives_the_seconds_their_sampling_took():
    from optimum_flatten.cli.summary import compression_summary

    own = {"rows": 2, "seconds": 0.01, "cached": True, "sampled": {"seconds": 3600.0}}
    report = {"method": "shortgpt", "plan_summary": "6 -> 5", "num_layers_before": 6, "num_layers_after": 5,
              "params_before": 10, "params_after": 8, "total_seconds": 1.0,
              "calibration": {"tokens": 128, "nsamples": 4, "own_text": own}}  # fmt: skip
    assert "2 of 4, sampled in 3600 s (read back from --resume-dir)" in compression_summary(report)


def test_the_model_card_says_the_model_wrote_part_of_its_calibration(tmp_path):
    model = tiny_models.tiny_llama_gqa()
    quantizer = FlattenQuantizer(tiny_config("shortgpt", num_layers_to_remove=1, own_text=0.5))
    quantizer.compress(model, TOKENIZER)
    quantizer.save(model, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "; 4 of the sequences written by the model itself before it was compressed (own_text=0.5" in card
