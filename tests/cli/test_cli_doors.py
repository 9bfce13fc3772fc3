"""Mistakes a user makes at the command line that used to cost the run or a model: refused in one line before any
work. The dense teacher's folder as `recover`'s output, a run's state folder inside its output, layer-collapse's
collapse options and row length (checked before it trains), and `evaluate`'s output files and token budget (checked
before it measures)."""

from __future__ import annotations

import hashlib

import pytest
import torch

import tiny_models
from common import dense_and_compressed_on_disk, one_error_line
from optimum_flatten.cli.main import main
from optimum_flatten.evaluation.perplexity import perplexity


def _digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_recover_refuses_to_write_over_the_dense_teachers_folder(tmp_path, capsys):
    dense, compressed = dense_and_compressed_on_disk(tmp_path, tiny_models.tiny_hf_tokenizer())
    before = _digest(dense)
    code = main(["recover", str(compressed), "--teacher", str(dense), "--output", str(dense), "--overwrite",
                 "--dataset", "teacher", "--max-tokens", "64", "--seqlen", "32"])  # fmt: skip
    assert code == 2 and "the folder the model was loaded from" in one_error_line(capsys)
    assert _digest(dense) == before


@pytest.mark.parametrize("inside", [False, True], ids=["the output", "inside the output"])
def test_a_state_folder_in_the_output_is_refused_before_any_work(tmp_path, capsys, monkeypatch, inside):
    import optimum_flatten.cli.main as cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model was loaded before the refusal"))
    out = tmp_path / "out"
    state = out / "state" if inside else out
    dense = tmp_path / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(dense)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(tiny_models.sample_texts(8)))
    code = main(["compress", str(dense), "--method", "flattengpt", "--num-layers-to-remove", "2", "--dataset",
                 str(text), "--resume-dir", str(state), "--output", str(out)])  # fmt: skip
    message = one_error_line(capsys)
    assert code == 2 and "--resume-dir" in message and ("inside the output" if inside else "is the output") in message
    assert not out.exists()


def test_recover_refuses_its_checkpoints_in_the_output_before_training(tmp_path, capsys):
    dense, compressed = dense_and_compressed_on_disk(tmp_path, tiny_models.tiny_hf_tokenizer())
    out = tmp_path / "healed"
    code = main(["recover", str(compressed), "--teacher", str(dense), "--output", str(out), "--checkpoint-dir",
                 str(out), "--dataset", "teacher", "--max-tokens", "64", "--seqlen", "32"])  # fmt: skip
    assert code == 2 and "--checkpoint-dir" in one_error_line(capsys) and not out.exists()


@pytest.fixture
def gpt2_and_text(tmp_path, monkeypatch):
    """A tiny GPT-2 on disk (128 positions), a text, and layer-collapse's training made to fail the test if reached."""
    import optimum_flatten.methods.layer_collapse as layer_collapse

    model = tmp_path / "gpt2"
    tiny_models.tiny_gpt2().save_pretrained(model)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(tiny_models.sample_texts(40)))
    monkeypatch.setattr(layer_collapse, "train_to_linear", lambda *a, **k: pytest.fail("trained before refusing"))
    return model, text


@pytest.mark.parametrize(
    "options, message",
    [
        (["--threshold", "-1"], "threshold"),
        (["--nsamples", "0"], "nsamples"),
        (["--seqlen", "200"], "position"),
        (["--threshold", "1e-5"], "--snap-learning-rate (5e-05) must be below --threshold (1e-05)"),
        (["--snap-learning-rate", "2e-4"], "--snap-learning-rate (0.0002) must be below --threshold (0.0001)"),
    ],
    ids=["threshold", "nsamples", "rows past the position table", "threshold under the snap rate", "snap rate"],
)
def test_layer_collapse_refuses_its_collapse_options_before_it_trains(gpt2_and_text, tmp_path, capsys, options,
                                                                    message):  # fmt: skip
    model, text = gpt2_and_text
    seqlen = [] if "--seqlen" in options else ["--seqlen", "16"]
    code = main(["layer-collapse", str(model), "--dataset", str(text), "--num-mlps", "1", *seqlen, *options,
                 "--output", str(tmp_path / "o")])  # fmt: skip
    assert code == 2 and message in one_error_line(capsys).lower() and not (tmp_path / "o").exists()


def test_layer_collapse_under_a_launcher_is_refused_before_it_trains(gpt2_and_text, tmp_path, capsys, monkeypatch):
    model, text = gpt2_and_text
    monkeypatch.setenv("WORLD_SIZE", "2")
    import optimum_flatten.utils.launch as launch

    monkeypatch.setattr(launch, "join_launcher_group", lambda: False)  # no group to join in this one process
    code = main(["layer-collapse", str(model), "--dataset", str(text), "--num-mlps", "1", "--output",
                 str(tmp_path / "o")])  # fmt: skip
    assert code == 2 and "in one process" in one_error_line(capsys)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--json", "{missing}/x.json"], "does not exist"),
        (["--plot", "{missing}/x.png"], "does not exist"),
        (["--json", "{folder}"], "is a folder"),
        (["--max-tokens", "0"], "at least 2"),
        (["--max-tokens", "-5"], "at least 2"),
    ],
    ids=["json folder missing", "plot folder missing", "json is a folder", "no tokens", "negative tokens"],
)
def test_evaluate_refuses_outputs_it_cannot_write_and_budgets_that_score_nothing_before_measuring(
    tmp_path, capsys, monkeypatch, options, message
):
    import optimum_flatten.cli.evaluate as evaluate

    monkeypatch.setattr(evaluate, "measure", lambda args: pytest.fail("measured before refusing"))
    model = tmp_path / "model"
    tiny_models.tiny_llama_gqa().save_pretrained(model)
    filled = [o.format(missing=tmp_path / "nowhere", folder=tmp_path) for o in options]
    code = main(["evaluate", str(model), "--dataset", str(model / "config.json"), *filled])
    assert code == 2 and message in one_error_line(capsys)


@pytest.mark.parametrize("max_tokens", [0, 1, -5])
def test_perplexity_refuses_a_budget_that_scores_nothing(max_tokens):
    tokens = torch.arange(3, 40)
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(tiny_models.tiny_llama_gqa(), tokens, seqlen=16, max_tokens=max_tokens)
    assert perplexity(tiny_models.tiny_llama_gqa(), tokens, seqlen=16, max_tokens=2).scored_tokens == 1


def test_compress_refuses_an_image_model_it_cannot_calibrate_with_advice_it_can_follow(tmp_path, capsys):
    """A ViT calibrates on pixel values, which the command line cannot give: the refusal named the API's
    arguments (a tokenizer, dataset= a tensor) as if they were flags."""
    folder = tmp_path / "vit"
    tiny_models.tiny_vit().save_pretrained(folder)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(tiny_models.sample_texts(8)))
    code = main(["compress", str(folder), "--method", "shortgpt", "--num-layers-to-remove", "1", "--dataset",
                 str(text), "--output", str(tmp_path / "out")])  # fmt: skip
    message = one_error_line(capsys)
    assert code == 2 and "calibrates on images, and the command line reads text" in message
    assert not (tmp_path / "out").exists()


def test_compress_keeps_an_image_text_models_processor(tmp_path, capsys):
    """Gemma 3's image-text checkpoint ships a processor (its image processor and processor_config.json besides the
    tokenizer): the command saved the tokenizer alone, and AutoProcessor could not load the compressed folder."""
    from transformers import AutoProcessor, AutoTokenizer, Gemma3ImageProcessor, Gemma3Processor

    dense = tmp_path / "gemma3"
    tiny_models.FACTORIES["gemma3"]().save_pretrained(dense)
    tiny_models.tiny_hf_tokenizer().save_pretrained(dense)
    special = {"boi_token": "<s>", "eoi_token": "</s>", "image_token": "<unk>"}
    tokenizer = AutoTokenizer.from_pretrained(dense, extra_special_tokens=special)
    image = Gemma3ImageProcessor(size={"height": 16, "width": 16})
    Gemma3Processor(image_processor=image, tokenizer=tokenizer, image_seq_length=4).save_pretrained(dense)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(tiny_models.sample_texts(40)))
    out = tmp_path / "out"
    argv = ["compress", str(dense), "--method", "shortgpt", "--num-layers-to-remove", "2", "--dataset", str(text),
            "--nsamples", "8", "--seqlen", "32", "--batch-size", "4", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    assert type(AutoProcessor.from_pretrained(out)).__name__ == "Gemma3Processor"
