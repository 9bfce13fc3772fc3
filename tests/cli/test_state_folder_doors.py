"""A run's state folder against its output, where a review found the checks missing: `compress --heal-checkpoint-dir`
inside (or equal to) `--output` and the same through `FlattenQuantizer.quantize(save_dir)` were found only by the save,
after the whole compression and healing; and `recover --output` inside `--checkpoint-dir` was accepted, then the
command advised removing that folder, healed model and all. And compress's ``--heal-*`` refusals, which named
RecoveryConfig's fields (``seqlen``: on compress the calibration's flag) and took ``--heal-mode none`` as a mode."""

from __future__ import annotations

import pytest

import tiny_models
from common import one_error_line
from optimum_flatten.cli.main import main


@pytest.fixture
def dense_and_text(tmp_path):
    dense = tmp_path / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(dense)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(tiny_models.sample_texts(8)))
    return dense, text


@pytest.mark.parametrize("inside", [False, True], ids=["the output", "inside the output"])
def test_compress_refuses_a_heal_checkpoint_dir_in_its_output_before_loading(
    dense_and_text, tmp_path, capsys, monkeypatch, inside
):
    import optimum_flatten.cli.main as cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model was loaded before the refusal"))
    dense, text = dense_and_text
    out = tmp_path / "out"
    state = out / "heal" if inside else out
    heal = ["--heal-tokens", "64", "--heal-checkpoint-dir", str(state)]
    code = main(["compress", str(dense), "--method", "flattengpt", "--num-layers-to-remove", "2", "--dataset",
                 str(text), *heal, "--output", str(out)])  # fmt: skip
    message = one_error_line(capsys)
    assert code == 2 and "--heal-checkpoint-dir" in message
    assert ("inside the output" if inside else "is the output") in message
    assert not out.exists()


def test_quantize_refuses_a_heal_checkpoint_dir_in_save_dir_before_compressing(dense_and_text, tmp_path, monkeypatch):
    from optimum_flatten import FlattenConfig, FlattenQuantizer

    dense, _ = dense_and_text
    out = tmp_path / "out"
    quantizer = FlattenQuantizer.from_pretrained(str(dense), tokenizer=tiny_models.CharTokenizer())
    monkeypatch.setattr(quantizer, "compress", lambda *a, **k: pytest.fail("compressed before refusing"))
    config = FlattenConfig(
        num_layers_to_remove=2,
        dataset=tiny_models.sample_texts(),
        nsamples=4,
        seqlen=24,
        heal={"max_tokens": 64, "checkpoint_dir": str(out / "heal")},
    )
    with pytest.raises(ValueError, match=r"heal\['checkpoint_dir'\] .* is inside the output folder"):
        quantizer.quantize(save_dir=out, quantization_config=config)
    assert not out.exists()


def test_recover_refuses_an_output_inside_its_checkpoint_dir_before_loading(tmp_path, capsys, monkeypatch):
    import transformers

    from common import dense_and_compressed_on_disk

    dense, compressed = dense_and_compressed_on_disk(tmp_path, tiny_models.tiny_hf_tokenizer())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    state = tmp_path / "run"
    code = main(["recover", str(compressed), "--teacher", str(dense), "--dataset", "teacher", "--max-tokens", "64",
                 "--seqlen", "32", "--checkpoint-dir", str(state), "--output", str(state / "healed")])  # fmt: skip
    message = one_error_line(capsys)
    assert code == 2 and "is inside --checkpoint-dir" in message and "outside the run's state folder" in message
    assert not state.exists()


@pytest.mark.parametrize(
    "heal, message",
    [
        (
            ["--heal-seqlen", "1"],
            "seqlen must be at least 2 (a row trains each token on those before it), got 1. "
            "(on compress: seqlen is --heal-seqlen)",
        ),
        (["--heal-save-every", "5"], "--heal-save-every needs --heal-checkpoint-dir"),
        (["--heal-mode", "none", "--heal-seqlen", "1"], "(on compress: seqlen is --heal-seqlen)"),
    ],
    ids=["row length", "checkpoints without a folder", "mode none is the default"],
)
def test_compress_names_its_own_heal_flags_in_a_refusal(dense_and_text, tmp_path, capsys, monkeypatch, heal,
                                                        message):  # fmt: skip
    """RecoveryConfig's words are another flag's on compress (its --seqlen is the calibration's); `--heal-mode none`,
    listed among the choices, reached RecoveryConfig as the string 'none'."""
    import optimum_flatten.cli.main as cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model was loaded before the refusal"))
    dense, text = dense_and_text
    code = main(["compress", str(dense), "--method", "flattengpt", "--num-layers-to-remove", "2", "--dataset",
                 str(text), "--heal-tokens", "64", *heal, "--output", str(tmp_path / "out")])  # fmt: skip
    assert code == 2 and message in one_error_line(capsys)


def test_heal_mode_none_reads_as_the_default():
    from optimum_flatten.cli.main import build_parser
    from optimum_flatten.cli.options import heal_options

    args = build_parser().parse_args(["compress", "m", "--num-layers-to-remove", "2", "--heal-tokens", "64",
                                      "--heal-mode", "none", "--output", "o"])  # fmt: skip
    assert args.heal_mode is None and heal_options(args) == {"max_tokens": 64, "mode": None}


def test_quantize_refuses_a_resume_dir_in_save_dir_before_compressing(dense_and_text, tmp_path, monkeypatch):
    from optimum_flatten import FlattenConfig, FlattenQuantizer

    dense, _ = dense_and_text
    out = tmp_path / "out"
    quantizer = FlattenQuantizer.from_pretrained(str(dense), tokenizer=tiny_models.CharTokenizer())
    monkeypatch.setattr(quantizer, "compress", lambda *a, **k: pytest.fail("compressed before refusing"))
    config = FlattenConfig(num_layers_to_remove=2, dataset=tiny_models.sample_texts(), nsamples=4, seqlen=24,
                           resume_dir=str(out / "state"))  # fmt: skip
    with pytest.raises(ValueError, match=r"resume_dir .* is inside the output folder"):
        quantizer.quantize(save_dir=out, quantization_config=config)
    assert not out.exists()


def test_only_a_folder_the_run_advises_removing_may_not_hold_the_output(tmp_path):
    """A healing's checkpoint folder is removed once the model is saved; a teacher-text cache or a resume folder is
    kept, and may hold the output (``--teacher-text-cache work --output work/healed``)."""
    from optimum_flatten.utils.state_folders import check_state_folder

    work = tmp_path / "work"
    check_state_folder(str(work / "healed"), str(work), "--teacher-text-cache")
    check_state_folder(str(work / "model"), str(work), "--resume-dir")
    with pytest.raises(ValueError, match="is inside --checkpoint-dir"):
        check_state_folder(str(work / "healed"), str(work), "--checkpoint-dir", removed_after=True)
