import json

import pytest
import torch

import tiny_models
from optimum_flatten.cli.main import main


@pytest.fixture
def tiny_checkpoint(tmp_path, monkeypatch):
    model = tiny_models.tiny_llama_gqa()
    path = tmp_path / "dense"
    model.save_pretrained(path)
    tokenizer = tiny_models.CharTokenizer()

    def fake_load(name, dtype, trust_remote_code=False):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
        )
        return model.eval(), tokenizer

    monkeypatch.setattr("optimum_flatten.cli.main._load", fake_load)
    data = tmp_path / "calibration.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in tiny_models.sample_texts()))
    return path, data


def test_compress_writes_plain_checkpoint_with_heatmap(tiny_checkpoint, tmp_path, capsys):
    model_path, data = tiny_checkpoint
    out = tmp_path / "out"
    code = main(
        [
            "compress",
            str(model_path),
            "--num-layers-to-remove",
            "2",
            "--dataset",
            str(data),
            "--nsamples",
            "8",
            "--seqlen",
            "24",
            "--max-group-size",
            "3",
            "--calibration-mode",
            "sequential",
            "--output",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "6 -> 4" in printed and "saved to" in printed
    report = json.loads((out / "flatten_report.json").read_text())
    assert report["method_args"]["max_group_size"] == 3
    assert report["method_args"]["calibration_mode"] == "sequential"
    assert report["calibration"]["tokens"] == 8 * 24
    assert (out / "similarity_heatmap.png").exists()


def test_compress_collapses_a_remote_code_checkpoint_saved_mid_training(tiny_checkpoint, tmp_path, capsys):
    """A LayerCollapse checkpoint saved mid-training (alpha trained to 1, not collapsed yet) is remote code: the CLI
    loads it with --trust-remote-code, collapses, and writes a plain GPT-2 once every MLP is collapsed."""
    from transformers import GPT2LMHeadModel

    from common import assert_close, logits, sample_ids
    from optimum_flatten.methods.layer_collapse import prepare_layer_collapse_, save_layer_collapse

    model = tiny_models.tiny_gpt2()
    for activation in prepare_layer_collapse_(model, num_mlps=6).values():
        activation.alpha.data.fill_(1.0)
    saved = save_layer_collapse(model, tmp_path / f"{tmp_path.name}-alpha-one")
    _, data = tiny_checkpoint
    out = tmp_path / "collapsed"
    arguments = ["compress", str(saved), "--method", "layer_collapse", "--dataset", str(data), "--nsamples", "4"]
    code = main([*arguments, "--seqlen", "16", "--output", str(out), "--no-progress", "--trust-remote-code"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "flatten_report.json").read_text())
    assert report["export_format"] == "stock"
    assert [r["layer"] for r in report["layer_collapse"]["collapsed"]] == list(range(6))
    plain = GPT2LMHeadModel.from_pretrained(out).eval()
    ids = sample_ids()
    assert_close(logits(plain, ids), logits(model, ids))


def test_layer_collapse_verb_trains_collapses_and_saves(tiny_checkpoint, tmp_path, capsys):
    """prepare -> AdamLC pull-then-land -> collapse -> save, in one command, on a GPT-2: the last two of six MLPs
    reach alpha = 1 and collapse with a small measured error, and the remote-code checkpoint reloads."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "gpt2"
    tiny_models.tiny_gpt2().save_pretrained(model_dir)
    _, data = tiny_checkpoint
    out = tmp_path / f"{tmp_path.name}-collapsed"
    schedule = ["--pull-steps", "6", "--pull-per-step", "0.5", "--snap-steps", "2", "--batch-size", "2"]
    arguments = ["layer-collapse", str(model_dir), "--dataset", str(data), "--num-mlps", "2", "--seqlen", "16"]
    code = main([*arguments, "--nsamples", "4", *schedule, "--output", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "remote_code" in captured.out and "AutoModelForCausalLM.from_pretrained" in captured.out
    report = json.loads((out / "flatten_report.json").read_text())
    assert [r["layer"] for r in report["layer_collapse"]["collapsed"]] == [4, 5]
    assert all(abs(1 - r["alpha"]) < 1e-4 and r["relative_error"] < 1e-3 for r in report["layer_collapse"]["collapsed"])
    assert report["training"]["pull"]["steps"] == 6 and report["training"]["snap"]["steps"] == 2
    assert report["parameters_after"] < report["parameters_before"]
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert type(reloaded).__name__ == "LayerCollapseGPT2LMHeadModel"
    assert json.loads((out / "config.json").read_text())["use_cache"] is True  # as the source's (the Trainer's False)


def test_layer_collapse_verb_refuses_what_it_cannot_do(tiny_checkpoint, tmp_path, capsys):
    model_path, data = tiny_checkpoint  # a gated LLaMA MLP cannot collapse
    code = main(["layer-collapse", str(model_path), "--dataset", str(data), "--output", str(tmp_path / "o")])
    assert code == 2 and "--num-mlps" in capsys.readouterr().err
    code = main(
        ["layer-collapse", str(model_path), "--dataset", str(data), "--num-mlps", "1", "--output", str(tmp_path / "o")]
    )
    assert code == 2 and "bilinear" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_errors_are_clear_and_early(tiny_checkpoint, tmp_path, capsys):
    model_path, data = tiny_checkpoint
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    code = main(
        [
            "compress",
            str(model_path),
            "--num-layers-to-remove",
            "2",
            "--dataset",
            str(data),
            "--output",
            str(out),
        ]
    )
    assert code == 2
    assert "not empty" in capsys.readouterr().err
    code = main(
        [
            "compress",
            str(model_path),
            "--method",
            "shortgpt",
            "--num-layers-to-remove",
            "2",
            "--max-group-size",
            "2",
            "--dataset",
            str(data),
            "--output",
            str(tmp_path / "o2"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "--max-group-size (flattengpt) is an option of another method, not of --method shortgpt" in err
    assert "shortgpt's own options:" in err and "quant_method" not in err


def test_compress_warns_once_when_a_merge_raises_the_calibration_loss_past_the_bound(
    tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    """LaCo with a searched threshold (what an older refusal advised) reaches any target; the CLI then says, after
    the summary and once, that the merged model's calibration loss rose past ln 2 (here the bound is lowered so that
    the tiny model's rise passes it)."""
    from optimum_flatten.methods.laco import search as stack_search

    model_path, data = tiny_checkpoint
    arguments = ["compress", str(model_path), "--method", "laco", "--laco-threshold", "none", "--window-size", "2"]
    arguments += ["--num-layers-to-remove", "2", "--dataset", str(data), "--nsamples", "8", "--seqlen", "24"]
    assert main([*arguments, "--output", str(tmp_path / "a"), "--no-progress"]) == 0
    report = json.loads((tmp_path / "a" / "flatten_report.json").read_text())
    assert report["calibration_loss"]["bound"] == pytest.approx(0.693147, abs=1e-6)
    assert ("warning:" in capsys.readouterr().err) == (report["calibration_loss"]["rise"] > 0.693147)
    monkeypatch.setattr(stack_search, "NLL_RISE_BOUND", -1.0)
    assert main([*arguments, "--output", str(tmp_path / "b"), "--no-progress"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "ln 2 (perplexity doubled)" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: laco: the merged model's mean next-token loss")
    assert "saved to" in captured.out


def test_flags_are_generated_from_the_config_fields():
    import dataclasses

    from optimum_flatten.cli.main import build_parser
    from optimum_flatten.cli.options import config_kwargs
    from optimum_flatten.methods.flattengpt import FlattenGPTConfig

    parser = build_parser()
    help_text = parser._subparsers._group_actions[0].choices["compress"].format_help()
    for field in dataclasses.fields(FlattenGPTConfig):
        assert "--" + field.name.replace("_", "-") in help_text
    args = parser.parse_args(
        [
            "compress",
            "m",
            "--output",
            "o",
            "--target-sparsity",
            "0.2",
            "--max-group-size",
            "none",
            "--attention-correction",
            "true",
            "--packing",
            "false",
        ]
    )
    assert config_kwargs(args) == {
        "method": "flattengpt",
        "target_sparsity": 0.2,
        "max_group_size": None,
        "attention_correction": True,
        "packing": False,
    }


def test_push_to_hub_offline_reports_and_keeps_local_save(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    from huggingface_hub import HfApi

    from tests.test_hub import _online

    _online(monkeypatch)  # the upload itself fails here (a closed port), not the offline check before the work

    monkeypatch.setattr("huggingface_hub.HfApi", lambda token=None: HfApi(endpoint="http://127.0.0.1:9", token="x"))
    model_path, data = tiny_checkpoint
    out = tmp_path / "out"
    code = main(
        [
            "compress",
            str(model_path),
            "--num-layers-to-remove",
            "1",
            "--method",
            "shortgpt",
            "--dataset",
            str(data),
            "--nsamples",
            "4",
            "--seqlen",
            "24",
            "--output",
            str(out),
            "--push-to-hub",
            "me/repo",
            "--no-progress",
        ]
    )
    assert code == 2
    assert "could not upload to the Hub repo 'me/repo'" in capsys.readouterr().err
    assert (out / "model.safetensors").exists() and (out / "README.md").exists()


@pytest.fixture
def tiny_dir_with_tokenizer(llama_on_disk):
    return llama_on_disk


def test_compress_evaluate_recover_round_trip(tiny_dir_with_tokenizer, tmp_path, capsys):
    dense, data = tiny_dir_with_tokenizer
    compressed = tmp_path / "compressed"
    assert (
        main(
            [
                "compress",
                str(dense),
                "--num-layers-to-remove",
                "2",
                "--dataset",
                str(data),
                "--nsamples",
                "8",
                "--seqlen",
                "32",
                "--output",
                str(compressed),
                "--no-progress",
            ]
        )
        == 0
    )
    plot, measurements = tmp_path / "eval.png", tmp_path / "eval.json"
    assert (
        main(
            [
                "evaluate",
                str(compressed),
                "--baseline",
                str(dense),
                "--dataset",
                str(data),
                "--seqlen",
                "32",
                "--max-tokens",
                "512",
                "--plot",
                str(plot),
                "--json",
                str(measurements),
                "--lm-eval-tasks",
                "local_text_perplexity",
                "--lm-eval-limit",
                "3",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "ppl ratio" in printed and "KL vs baseline" in printed and "decode ratio" in printed
    assert plot.read_bytes()[:4] == b"\x89PNG"
    models = json.loads(measurements.read_text())["models"]
    assert [m["layers"] for m in models] == [6, 4]
    assert models[0]["protocol"] == models[1]["protocol"]
    measured = models[1]["fidelity"]  # on the same windows and tokens as the perplexity beside it
    assert measured["protocol"] == models[1]["protocol"] and measured["kl"] > 0 and 0 <= measured["top1_agreement"] <= 1
    assert measured["compressed_perplexity"] == pytest.approx(models[1]["perplexity"], rel=1e-5)
    assert measured["dense_perplexity"] == pytest.approx(models[0]["perplexity"], rel=1e-5)
    assert all(m["lm_eval"]["local_text_perplexity"]["word_perplexity,none"] > 1 for m in models)

    recovered = tmp_path / "recovered"
    assert (
        main(
            [
                "recover",
                str(compressed),
                "--dataset",
                str(data),
                "--output",
                str(recovered),
                "--max-steps",
                "2",
                "--seqlen",
                "32",
                "--per-device-train-batch-size",
                "2",
                "--layers-to-transform",
                "0",
                "1",
            ]
        )
        == 0
    )
    report = json.loads((recovered / "flatten_report.json").read_text())
    assert report["recovery"]["steps"] == 2 and report["plan"]["groups"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(recovered).config.num_hidden_layers == 4


def test_evaluate_against_itself_has_zero_kl_and_full_agreement(tiny_dir_with_tokenizer, capsys):
    dense, data = tiny_dir_with_tokenizer
    common = ["evaluate", str(dense), "--baseline", str(dense), "--dataset", str(data), "--seqlen", "32"]
    assert main([*common, "--max-tokens", "256", "--no-speed"]) == 0
    header, _, dense_row, row = capsys.readouterr().out.splitlines()[:4]
    assert [c.strip() for c in header.split(" | ")[4:]] == ["KL vs baseline", "top-1 agreement", "greedy agreement"]
    assert [c.strip() for c in dense_row.split(" | ")[4:]] == ["-", "-", "-"]  # the baseline is the reference
    assert [c.strip() for c in row.split(" | ")[4:]] == ["0.0000", "1.0000", "1.000"]
    assert main([*common, "--max-tokens", "64", "--no-speed", "--no-fidelity", "--no-generation"]) == 0
    out = capsys.readouterr().out
    assert "KL" not in out and "greedy" not in out


def test_optimum_cli_registration_is_light_and_forwards_to_our_parser():
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    spec = importlib.util.find_spec("optimum.commands.register")
    folders = [Path(p) for p in spec.submodule_search_locations]
    ours = [f for f in folders if (f / "flatten.py").exists()]
    assert ours and not (ours[0] / "__init__.py").exists()
    code = (
        "import sys, optimum.commands.register.flatten as r;"
        "print(sorted(m for m in ('torch', 'transformers', 'optimum_flatten') if m in sys.modules),"
        " r.REGISTER_COMMANDS[0].COMMAND.name)"
    )
    light = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert light.stdout.strip() == "[] flatten"
    cli = subprocess.run(["optimum-cli", "flatten", "compress", "--help"], capture_output=True, text=True)
    assert cli.returncode == 0 and "--num-layers-to-remove" in cli.stdout and "--max-group-size" in cli.stdout


def test_linear_replacement_and_replaceme_options_reach_the_config():
    from optimum_flatten.cli.main import build_parser
    from optimum_flatten.cli.options import config_kwargs

    parser = build_parser()
    args = parser.parse_args(
        [
            "compress",
            "m",
            "--output",
            "o",
            "--method",
            "shortgpt",
            "--num-layers-to-remove",
            "2",
            "--linear-replacement",
            "cosine",
        ]
    )
    assert config_kwargs(args) == {"method": "shortgpt", "num_layers_to_remove": 2, "linear_replacement": "cosine"}
    args = parser.parse_args(
        [
            "compress",
            "m",
            "--output",
            "o",
            "--method",
            "replaceme",
            "--num-layers-to-remove",
            "2",
            "--estimator",
            "cosine",
            "--tokens",
            "all",
            "--num-blocks",
            "2",
        ]
    )
    assert config_kwargs(args) == {
        "method": "replaceme",
        "num_layers_to_remove": 2,
        "estimator": "cosine",
        "tokens": "all",
        "num_blocks": 2,
    }


@pytest.mark.parametrize(
    ("method", "value"),
    [("replaceme", "loss"), ("flattengpt", "loss"), ("flattengpt", "wide_loss"), ("ffn_merge", "nll")],
)
def test_an_option_several_methods_share_takes_each_methods_own_values(method, value):
    """`selection` means something else in ffn_merge, ReplaceMe and FlattenGPT: each has its own flag
    (``--<method>-selection``), which reaches that method's config, and the config is what checks the value."""
    from optimum_flatten import FlattenConfig
    from optimum_flatten.cli.main import build_parser
    from optimum_flatten.cli.options import config_kwargs

    argv = ["compress", "m", "--output", "o", "--method", method, f"--{method.replace('_', '-')}-selection", value]
    if method != "ffn_merge":
        argv += ["--num-layers-to-remove", "2"]
    kwargs = config_kwargs(build_parser().parse_args(argv))
    assert kwargs["selection"] == value
    assert FlattenConfig(**kwargs).method_config.selection == value


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--method", "replaceme", "--selection", "loss"], "for --method replaceme say --replaceme-selection loss"),
        (["--method", "shortgpt", "--selection", "loss"], "--method shortgpt has no such option"),
        (["--method", "laco", "--threshold", "0.5"], "for --method laco say --laco-threshold 0.5"),
        (
            ["--method", "replaceme", "--flattengpt-selection", "loss"],
            "--flattengpt-selection is an option of flattengpt",
        ),
    ],
)
def test_options_that_mean_different_things_per_method_are_refused_unqualified(argv, expected, tmp_path, capsys):
    """The plain spelling of a namespaced option, and another method's namespaced flag, are refused in one line that
    names the flag meant, before anything loads."""
    out = tmp_path / "o"
    assert main(["compress", "m", "--output", str(out), "--num-layers-to-remove", "2", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_only_options_declared_differently_are_namespaced():
    from optimum_flatten.cli.options import namespaced_options
    from optimum_flatten.registry import registered_methods

    assert namespaced_options(registered_methods()) == {"selection", "threshold"}


def test_a_shared_options_value_of_another_method_is_refused_in_one_line(tiny_checkpoint, tmp_path, capsys):
    argv = ["compress", str(tiny_checkpoint), "--output", str(tmp_path / "o"), "--num-layers-to-remove", "2"]
    with pytest.raises(SystemExit) as exit_info:  # ffn_merge's value for FlattenGPT's option: argparse's choices
        main([*argv, "--flattengpt-selection", "nll"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--flattengpt-selection: invalid choice: 'nll'" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("offline", [False, True], ids=["bad repo id", "offline"])
def test_a_push_that_cannot_happen_is_refused_before_the_model_loads(tiny_checkpoint, tmp_path, capsys, monkeypatch,
                                                                    offline):  # fmt: skip
    from tests.test_hub import _online

    _online(monkeypatch)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("optimum_flatten.cli.main._load", lambda *a, **k: pytest.fail("loaded before refusing"))
    model_path, data = tiny_checkpoint
    repo = "me/repo" if offline else "a/b/c"
    argv = ["compress", str(model_path), "--num-layers-to-remove", "1", "--method", "shortgpt", "--dataset",
            str(data), "--output", str(tmp_path / "out"), "--push-to-hub", repo]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert ("offline mode is on" if offline else "not a valid Hub repo id") in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()
