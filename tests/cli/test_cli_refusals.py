"""What a new user meets on the command line: every refusal is one line and exit 2, before any work, saying what to
do (missing or corrupt checkpoints, unwritable outputs, sequence lengths past a model's positions, misspelt flags,
options of another method, an unknown demo method), and evaluate takes bundled names and refuses baselines whose
tokenizer differs unless asked to compare bits per byte."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import tiny_models
from optimum_flatten.cli.main import main


@pytest.fixture
def no_loading(monkeypatch):
    """Makes every model load fail loudly: a refusal that comes "before any work" never gets there."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded although the request should have been refused first")

    monkeypatch.setattr("optimum_flatten.cli.main._load", refuse)
    monkeypatch.setattr("optimum_flatten.bundled.load_smollm2", refuse)
    monkeypatch.setattr("optimum_flatten.bundled.load_bundled", refuse)


@pytest.fixture
def dense(llama_on_disk):
    return llama_on_disk


def _error_line(capsys) -> str:
    """The whole stderr, which must be exactly one line."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _compress(model: str, data: Path, out: Path, *extra: str) -> list[str]:
    return ["compress", model, "--num-layers-to-remove", "2", "--dataset", str(data), "--output", str(out), *extra]


@pytest.mark.parametrize("name", ["./no-such-model", "no/such/model", "../elsewhere/model"])
def test_a_missing_local_path_is_one_line_and_never_reaches_the_hub(name, tmp_path, capsys, no_loading, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was asked about a local path")

    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", no_hub)
    assert main(_compress(name, tmp_path / "d.txt", tmp_path / "out")) == 2
    line = _error_line(capsys)
    assert f"no such folder {name!r}" in line and "check the path" in line
    assert not (tmp_path / "out").exists()


def test_a_hub_like_name_is_not_looked_up_offline(tmp_path, capsys, no_loading, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda *a, **k: None)
    assert main(_compress("someone/some-model", tmp_path / "d.txt", tmp_path / "out")) == 2
    line = _error_line(capsys)
    assert "no such folder 'someone/some-model'" in line and "HF_HUB_OFFLINE is set" in line


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"model_type": "llama",', "is not valid JSON"),
        ("[1, 2]", "holds a JSON list"),
        (None, "holds no config.json"),
    ],
)
def test_a_broken_checkpoint_folder_is_one_line(content, expected, tmp_path, capsys, no_loading):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    if content is not None:
        (folder / "config.json").write_text(content)
    assert main(_compress(str(folder), tmp_path / "d.txt", tmp_path / "out")) == 2
    line = _error_line(capsys)
    assert expected in line and str(folder) in line


def test_a_corrupt_config_is_one_line_in_evaluate_too(dense, capsys):
    path, data = dense
    (path / "config.json").write_text("{not json")
    assert main(["evaluate", str(path), "--dataset", str(data), "--no-speed"]) == 2
    assert "is not valid JSON (Expecting property name" in _error_line(capsys)


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        (lambda path, data: ["--json", str(path / "config.json")], "would be written over the checkpoint"),
        (lambda path, data: ["--plot", str(path / "figure.png")], "would be written over the checkpoint"),
        (lambda path, data: ["--json", str(data)], "would be written over --dataset"),
        (lambda path, data: ["--json", str(path.parent / "m.png"), "--plot", str(path.parent / "m.png")], "the same"),
    ],
    ids=["config.json", "into-the-checkpoint", "the-text", "json-is-plot"],
)
def test_evaluate_never_writes_its_outputs_over_what_it_reads(dense, capsys, no_loading, outputs, message):
    """`--json` over the checkpoint's config.json left a folder that no longer loads (review J)."""
    path, data = dense
    before = {f: f.read_bytes() for f in [*path.iterdir(), data]}
    assert main(["evaluate", str(path), "--dataset", str(data), "--no-speed", *outputs(path, data)]) == 2
    assert message in _error_line(capsys)
    assert {f: f.read_bytes() for f in [*path.iterdir(), data]} == before


def _unwritable_parent(tmp_path: Path) -> Path:
    """A folder this process cannot create anything in, whoever runs the tests (root ignores permission bits)."""
    if os.name == "posix" and os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        return locked
    for candidate in (Path("/sys"), Path("/proc")):
        try:
            tempfile.mkdtemp(dir=candidate)
        except OSError:
            return candidate
    pytest.skip("no unwritable folder on this machine")


def test_an_output_under_an_unwritable_folder_is_refused_before_loading(dense, tmp_path, capsys, no_loading):
    path, data = dense
    parent = _unwritable_parent(tmp_path)
    out = parent / "optimum-flatten-test" / "out"
    assert main(_compress(str(path), data, out)) == 2
    line = _error_line(capsys)
    assert f"cannot write the output folder {str(out)!r}" in line and f"{str(parent)!r} is not writable" in line


def test_the_quantizer_api_checks_the_source_folder_before_compressing(dense, monkeypatch):
    from optimum_flatten import FlattenConfig, FlattenQuantizer
    from optimum_flatten.utils.errors import OutputDirectoryError

    path, _ = dense
    quantizer = FlattenQuantizer.from_pretrained(str(path))
    monkeypatch.setattr(quantizer, "compress", lambda *a, **k: pytest.fail("compressed before refusing the output"))
    config = FlattenConfig(num_layers_to_remove=2, dataset=tiny_models.sample_texts(), nsamples=4, seqlen=24)
    with pytest.raises(OutputDirectoryError, match="the folder the model was loaded from"):
        quantizer.quantize(save_dir=path, quantization_config=config, overwrite=True)


def test_seqlen_past_learned_positions_is_refused_before_calibration(monkeypatch):
    from optimum_flatten import FlattenConfig, FlattenQuantizer
    from optimum_flatten.utils.errors import CalibrationDataError

    model = tiny_models.tiny_gpt2()  # n_positions = 128
    state = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr("optimum_flatten.quantizer.draw_dataset_rows", lambda *a: pytest.fail("calibrated first"))
    config = FlattenConfig(
        method="shortgpt", num_layers_to_remove=1, dataset=tiny_models.sample_texts(), nsamples=2, seqlen=129
    )
    with pytest.raises(
        CalibrationDataError, match=r"seqlen=129 is longer than the 128 positions .*config\.n_positions"
    ):
        FlattenQuantizer(config, progress=False).compress(model, tiny_models.CharTokenizer())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_seqlen_past_rope_training_length_warns(caplog):
    from optimum_flatten.utils.positions import check_sequence_length

    model = tiny_models.tiny_llama_gqa()  # RoPE, max_position_embeddings = 128
    with caplog.at_level("WARNING", logger="optimum_flatten.utils.positions"):
        check_sequence_length(model, 128)
        assert not caplog.records
        check_sequence_length(model, 129)
    assert "max_position_embeddings = 128" in caplog.text and "seqlen <= 128" in caplog.text


@pytest.mark.parametrize("factory", ["bert", "marian"])
def test_seqlen_past_a_position_table_is_refused_for_encoders_too(factory):
    from optimum_flatten.utils.errors import CalibrationDataError
    from optimum_flatten.utils.positions import check_sequence_length

    with pytest.raises(CalibrationDataError, match="max_position_embeddings"):
        check_sequence_length(tiny_models.FACTORIES[factory](), 129)


def test_evaluate_refuses_a_seqlen_past_learned_positions_before_loading(tmp_path, capsys):
    path = tmp_path / "gpt2"
    tiny_models.tiny_gpt2().save_pretrained(path)
    capsys.readouterr()  # the save's progress bar
    assert main(["evaluate", str(path), "--seqlen", "256", "--no-speed"]) == 2
    assert "--seqlen=256 is longer than the 128 positions" in _error_line(capsys)


def test_an_unknown_flag_gets_a_did_you_mean_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_code:
        main(["compress", "m", "--output", "o", "--max-grup-size", "2"])
    assert exit_code.value.code == 2
    line = _error_line(capsys)
    assert "unrecognized arguments: --max-grup-size 2" in line and "did you mean '--max-group-size'?" in line


def test_flags_are_not_abbreviated(capsys):
    """A prefix is an unknown flag (with a suggestion), not silently the longer flag it starts."""
    with pytest.raises(SystemExit):
        main(["compress", "m", "--output", "o", "--num-layers", "2"])
    assert "did you mean '--num-layers-to-remove'?" in _error_line(capsys)


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_code:
        main(["compress", "m", "--output", "o", "--nsamples", "many"])
    assert exit_code.value.code == 2
    assert "invalid int value: 'many'" in _error_line(capsys)


def test_an_option_of_another_method_lists_the_chosen_methods_own_flags(tmp_path, capsys, no_loading):
    assert main(_compress("m", tmp_path / "d.txt", tmp_path / "out", "--window-size", "3")) == 2
    line = _error_line(capsys)
    assert re.search(
        r"--window-size \([^)]*laco[^)]*\) is an option of another method, not of --method flattengpt", line
    )
    assert "--max-group-size" in line and "--calibration-mode" in line
    for internal in ("quant_method", "version", "layer_plan", "stacks", "--interval"):
        assert internal not in line


def test_demo_refuses_an_unknown_method_before_any_work(capsys, no_loading):
    with pytest.raises(SystemExit) as exit_code:
        main(["demo", "--method", "foo"])
    assert exit_code.value.code == 2
    assert "invalid choice: 'foo'" in _error_line(capsys)


def test_demo_checks_the_whole_config_before_loading(capsys, no_loading):
    assert main(["demo", "--method", "ffn_merge"]) == 2  # keeps depth: a layer count makes no sense
    assert "ffn_merge" in _error_line(capsys)


def test_evaluate_takes_a_bundled_name_as_baseline(dense, monkeypatch, capsys):
    path, data = dense
    monkeypatch.setattr("optimum_flatten.bundled.bundled_model_path", lambda key: path)
    common = ["--dataset", str(data), "--seqlen", "32", "--max-tokens", "128", "--no-speed"]
    assert main(["evaluate", str(path), "--baseline", "smollm2", *common]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[2].startswith("smollm2 ") and "0.0000" in rows[3]  # the baseline row, then itself: KL 0


def _word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary's ids: the same text, other tokens than the character one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["state", "union", "the", "of", "people", "nation", "law", "year", "work", "peace", "and", "we"]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_evaluate_refuses_a_baseline_with_another_tokenizer_or_compares_bits_per_byte(dense, tmp_path, capsys):
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_flatten.calibration.data import load_texts
    from optimum_flatten.evaluation import perplexity, tokenize_corpus
    from optimum_flatten.evaluation.tokenization import text_budget

    path, data = dense
    other = tmp_path / "other"
    tiny_models.tiny_llama_gqa().save_pretrained(other)
    _word_tokenizer().save_pretrained(other)
    capsys.readouterr()  # the save's progress bar
    common = [str(path), "--baseline", str(other), "--dataset", str(data), "--seqlen", "32", "--no-speed"]
    assert main(["evaluate", *common, "--max-tokens", "256"]) == 2
    line = _error_line(capsys)
    assert "tokenise the evaluation text differently (token 0 is" in line and "--allow-different-tokenizers" in line

    measurements = tmp_path / "m.json"
    args = ["evaluate", *common, "--max-tokens", "256", "--allow-different-tokenizers", "--json", str(measurements)]
    assert main(args) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "bits/byte ratio" in header and "ppl ratio" not in header and "KL vs baseline" not in header
    entries = json.loads(measurements.read_text())["models"]
    # Naive reference: each model on the text the baseline's 256 tokens cover, in its own tokens.
    texts = text_budget(_word_tokenizer(), load_texts(str(data)), 256)
    size = sum(len(t.encode()) for t in texts)
    for folder, entry in zip((other, path), entries, strict=True):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        stream = tokenize_corpus(tokenizer, texts)
        result = perplexity(AutoModelForCausalLM.from_pretrained(folder).eval(), stream, seqlen=32)
        assert entry["bits_per_byte"] == pytest.approx(result.nll / math.log(2) * stream.numel() / size, rel=1e-5)
    assert entries[0]["path"] == str(other) and 250 <= len(tokenize_corpus(_word_tokenizer(), texts)) <= 256


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _not_safetensors(path: Path) -> None:
    path.write_bytes(b"this is a text file that someone saved under the name of the weights\n" * 4)


def _too_short(path: Path) -> None:
    path.write_bytes(b"abc")


@pytest.mark.parametrize(
    ("damage", "expected"),
    [(_truncate, "truncated"), (_not_safetensors, "truncated, or not safetensors"), (_too_short, "shorter than")],
)
@pytest.mark.parametrize("verb", ["compress", "evaluate"])
def test_broken_weights_are_one_line_before_loading(verb, damage, expected, dense, tmp_path, capsys, no_loading):
    """A download cut short or a file of another format under model.safetensors: refused by name, before any load
    (the safetensors library would raise a traceback naming no file, once the model is being built)."""
    model, data = dense
    damage(model / "model.safetensors")
    argv = _compress(str(model), data, tmp_path / "out") if verb == "compress" else ["evaluate", str(model)]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert "model.safetensors" in line and expected in line and "restore it" in line
    assert not (tmp_path / "out").exists()


def test_an_intact_checkpoint_passes_the_weights_check(dense):
    from optimum_flatten.utils.loading import safetensors_problem

    assert safetensors_problem(dense[0] / "model.safetensors") is None


def test_a_malformed_calibration_record_names_the_file_and_line_before_loading(dense, tmp_path, capsys, no_loading):
    model, _ = dense
    data = tmp_path / "calib.jsonl"
    data.write_text('{"text": "a good record"}\n\n{"text": "bad\x01 record"}\n', encoding="utf-8")
    assert main(_compress(str(model), data, tmp_path / "out")) == 2
    line = _error_line(capsys)
    assert "line 3 of" in line and "calib.jsonl" in line and "bad" in line and "Invalid control character" in line


def test_no_dataset_is_refused_first_and_alone(dense, tmp_path, capsys, no_loading):
    """The refusal comes before the model loads, so no warning about the calibration settings precedes it."""
    model, _ = dense
    argv = ["compress", str(model), "--num-layers-to-remove", "2", "--output", str(tmp_path / "out")]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert line.startswith("error: no calibration text given: pass --dataset")


ARGUMENT_ERRORS = [
    ["compress", "{model}", "--num-layers-to-remove", "2", "--dataset", "{data}", "--output", "{out}", "--thresh", "1"],
    ["compress", "{model}", "--num-layers-to-remove", "2", "--dataset", "{data}", "--outptu", "{out}"],
    [
        "compress",
        "{model}",
        "--num-layers-to-remove",
        "2",
        "--dataset",
        "{data}",
        "--output",
        "{out}",
        "--nsamples",
        "0",
    ],
    [
        "compress",
        "{model}",
        "--num-layers-to-remove",
        "2",
        "--dataset",
        "{data}",
        "--output",
        "{out}",
        "--method",
        "shortgpt",
        "--max-group-size",
        "3",
    ],
    [
        "compress",
        "{model}",
        "--num-layers-to-remove",
        "2",
        "--dataset",
        "{data}",
        "--output",
        "{out}",
        "--max-group-size",
        "0",
    ],
    ["evaluate", "{model}", "--seqlen", "many"],
    ["recover", "{model}", "--dataset", "{data}", "--output", "{out}", "--mode", "everything"],
    ["estimate", "{model}", "--num-layers-to-remove", "2", "--method", "nonesuch"],
]


def _console_script() -> list[str]:
    script = shutil.which("optimum-flatten")
    return [script] if script else [sys.executable, "-m", "optimum_flatten.cli.main"]


@pytest.mark.parametrize("argv", ARGUMENT_ERRORS, ids=lambda argv: " ".join(argv[4:] if len(argv) > 4 else argv))
def test_argument_errors_import_neither_torch_nor_transformers(argv, tmp_path):
    """Every argument error is refused from the options' declarations: the process that refuses it never imports
    torch or transformers (which took 10 s of CPU before the message)."""
    argv = [a.format(model=tmp_path / "model", data=tmp_path / "text.txt", out=tmp_path / "out") for a in argv]
    code = (
        "import sys\nfrom optimum_flatten.cli.main import main\n"
        f"try:\n    code = main({argv!r})\nexcept SystemExit as exit_:\n    code = exit_.code\n"
        "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["2", "False", "False"], result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_argument_errors_take_a_fraction_of_a_second_of_cpu(tmp_path):
    """Through the console script, as a user meets it: each refusal in one line with exit 2, in well under 2 s of CPU
    (about 0.2 s measured on 2 idle cores; the bound is generous because CPU time does not depend on the load)."""
    for argv in ARGUMENT_ERRORS:
        argv = [a.format(model=tmp_path / "model", data=tmp_path / "text.txt", out=tmp_path / "out") for a in argv]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run([*_console_script(), *argv], capture_output=True, text=True, timeout=120)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert cpu < 2.0, f"{argv}: {cpu:.2f} s of CPU before the refusal"


def test_a_local_source_is_never_named_by_its_path_in_the_saved_checkpoint(dense, tmp_path, capsys):
    """The card, the report and every other text file of the output name a local source by its folder's name only:
    `--push-to-hub` must not publish the user's directory layout."""
    model, data = dense
    out = tmp_path / "out"
    argv = [
        "compress",
        str(model),
        "--method",
        "shortgpt",
        "--num-layers-to-remove",
        "1",
        "--dataset",
        str(data),
        "--nsamples",
        "4",
        "--seqlen",
        "32",
        "--no-progress",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    texts = {p.name: p.read_text(errors="replace") for p in out.iterdir() if p.suffix in (".json", ".md", ".txt")}
    assert "README.md" in texts and "flatten_report.json" in texts
    leaks = [name for name, text in texts.items() if str(model.parent) in text or str(model) in text]
    assert leaks == []
    report = json.loads(texts["flatten_report.json"])
    assert report["base_model"] == "dense" and report["base_model_on_hub"] is False


@pytest.mark.parametrize("verbose", [False, True])
def test_the_hubs_log_lines_show_once_and_only_with_verbose(monkeypatch, verbose):
    """huggingface_hub's retries of an unreachable Hub were printed twice each (its own handler and the root's),
    before the command's one error line."""
    import logging

    from optimum_flatten.cli import main as cli_main

    hub_logger = logging.getLogger("huggingface_hub")
    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append((record.getMessage(), hub_logger.propagate))

    collector = Collect()
    hub_logger.addHandler(collector)

    def command(args):
        logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        return 0

    monkeypatch.setattr(cli_main, "cmd_estimate", command)
    monkeypatch.setattr(cli_main, "VERBS", tuple(
        dataclasses.replace(v, command=command) if v.name == "estimate" else v for v in cli_main.VERBS
    ))  # fmt: skip
    try:
        argv = (["-v"] if verbose else []) + ["estimate", "m", "--num-layers-to-remove", "2"]
        assert cli_main.main(argv) == 0
    finally:
        hub_logger.removeHandler(collector)
    # Shown with -v only, by the hub's own handler alone (not propagated to the root's as well).
    assert seen == ([("Retrying in 1s [Retry 1/5].", False)] if verbose else [])


@pytest.mark.parametrize(
    "argv, environment, message",
    [
        (["demo", "--overwrite"], {}, "--overwrite applies to the folder --output names"),
        (["demo", "--output", "{out}"], {"WORLD_SIZE": "2"}, "the demo runs in one process"),
    ],
    ids=["overwrite without output", "under a launcher"],
)
def test_the_demo_refuses_what_it_would_ignore_or_race_on(tmp_path, capsys, monkeypatch, argv, environment, message):
    """``demo --overwrite`` without ``--output`` did nothing; under torchrun every rank measured on its own and wrote
    --output over the others."""
    import optimum_flatten.bundled as bundled
    import optimum_flatten.utils.launch as launch

    monkeypatch.setattr(bundled, "load_smollm2", lambda *a, **k: pytest.fail("the model was loaded before refusing"))
    monkeypatch.setattr(launch, "join_launcher_group", lambda: False)  # no group to join in this one process
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert main([a.format(out=tmp_path / "out") for a in argv]) == 2
    assert message in _error_line(capsys) and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("name", "hint"), [("sotu:before2000", "sotu:before-2000"), ("bible:kjv1611", "bible:kjv")])
def test_a_misspelt_bundled_corpus_is_named_before_the_model_loads(dense, name, hint, no_loading, capsys):
    path, _ = dense
    args = ["compress", str(path), "--num-layers-to-remove", "2", "--dataset", name, "--output", "unused"]
    assert main(args) == 2
    line = _error_line(capsys)
    assert f"no bundled corpus is named {name!r}" in line and f"Did you mean {hint!r}?" in line, line


def test_evaluate_under_a_launcher_is_refused_before_the_models_load(dense, capsys, monkeypatch, tmp_path):
    """Every rank measured the whole evaluation, timed on the same cores or GPU, and wrote the same --json."""
    import optimum_flatten.utils.launch as launch

    path, _ = dense
    monkeypatch.setattr(launch, "join_launcher_group", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    assert main(["evaluate", str(path), "--json", str(tmp_path / "e.json")]) == 2
    assert "evaluate measures in one process" in _error_line(capsys) and not (tmp_path / "e.json").exists()
