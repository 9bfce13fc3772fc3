"""A target a method's options cannot reach is refused before calibration (`CompressionMethod.check_target`), by
`compress` and by `estimate` alike, in the plan's own words: it used to come from the plan, after the model was
loaded, the text tokenised, a calibration pass run, and the model's own rows written (hours at 7B)."""

from __future__ import annotations

import pytest

import tiny_models
from common import one_error_line
from optimum_flatten.cli.main import main

#: (method options on the tiny 6-layer LLaMA, what the refusal says).
REFUSED = [
    (["--method", "replaceme", "--num-layers-to-remove", "1", "--num-blocks", "5"], "cannot be split into 5 equal"),
    (["--method", "uidl", "--num-layers-to-remove", "3", "--num-blocks", "2"], "cannot be split into 2 equal"),
    (["--method", "sleb", "--num-layers-to-remove", "5", "--protect-first", "true", "--protect-last", "true"],
     "only 4 layers can be"),
    (["--method", "flattengpt", "--num-layers-to-remove", "4"],
     "within max_group_size=2 in a stack of 6 layers (at most 3"),
    (["--method", "come", "--num-layers-to-remove", "4", "--allow-chaining", "false"], "can lose at most 3"),
]  # fmt: skip


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense")
    tiny_models.tiny_llama_gqa().save_pretrained(folder)
    tiny_models.tiny_hf_tokenizer().save_pretrained(folder)
    (folder / "text.txt").write_text("\n".join(tiny_models.sample_texts(60)))
    return folder


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[a[1] for a, _ in REFUSED])
def test_compress_refuses_before_calibrating_and_estimate_refuses_alike(dense, tmp_path, capsys, monkeypatch, argv,
                                                                       message):  # fmt: skip
    from optimum_flatten import quantizer

    def calibrated(*args, **kwargs):
        raise AssertionError("the calibration was drawn before the refusal")

    monkeypatch.setattr(quantizer, "draw_dataset_rows", calibrated)
    capsys.readouterr()
    out = tmp_path / "out"
    sizes = ["--nsamples", "4", "--seqlen", "32", "--no-progress"]
    code = main(["compress", str(dense), *argv, "--dataset", str(dense / "text.txt"), *sizes, "--own-text", "0.5",
                 "--output", str(out)])  # fmt: skip
    assert code == 2 and message in one_error_line(capsys)
    assert not out.exists()
    assert main(["estimate", str(dense), *argv, "--nsamples", "4", "--seqlen", "32"]) == 2
    assert message in one_error_line(capsys)


def test_a_reachable_target_is_accepted_by_the_check(dense, capsys):
    assert main(["estimate", str(dense), "--method", "flattengpt", "--num-layers-to-remove", "3", "--nsamples", "4",
                 "--seqlen", "32"]) == 0  # fmt: skip
