"""The doors users go through, on every family: tiny random checkpoints written to disk, compressed by the command
line and by the API's own save (`FlattenQuantizer.save`), reloaded with plain transformers; each cell of the matrix
named by its family and method, so that one failure says where.

- **Claims**: every save asks every registered method whether the model is its own (`checkpoint_writer`); that
  question must be safe on every family, whatever its MLP (a mixture of experts has no dense one).
- **compress**: for every family the command line can load and every method, ``optimum-flatten compress`` either
  writes what the API writes on the same text (the same logits after a plain reload) or, where the API refuses,
  refuses in one line with exit 2 before writing anything.
- **The API's save, compress on load and the Hub**: `FlattenQuantizer.save` and `push_to_hub` (against a local
  stand-in for the Hub client) on every family, and ``from_pretrained(..., quantization_config=FlattenConfig(...))``.
- **The round trip**: ``compress`` -> plain reload -> ``evaluate`` against the dense model -> ``recover`` with a tiny
  budget, on every causal LM family.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import tiny_models
from common import sample_ids
from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.cli.main import main
from optimum_flatten.registry import get_method_class, registered_methods

pytestmark = pytest.mark.slow

#: Families the command line loads from a folder with a text calibration. Baichuan's modelling code ships with its
#: checkpoints (remote code the tests cannot write), ViT calibrates on images, and Marian's two stacks need
#: ``--stacks`` (its own test below); the API tests below and tests/adapters cover them. StarCoder2 has no adapter:
#: its refusal is tested below.
CLI_FAMILIES = sorted(set(tiny_models.FACTORIES) - {"baichuan", "vit", "marian", "starcoder2"})
#: Families whose model is a causal LM (what `evaluate` and `recover` take).
CAUSAL_FAMILIES = sorted(set(CLI_FAMILIES) - {"bert"})

#: method -> its options on the tiny models (the command line spells a method's own option with its prefix).
METHODS: dict[str, tuple[dict, list[str]]] = {
    "shortgpt": ({"num_layers_to_remove": 2}, ["--num-layers-to-remove", "2"]),
    "sleb": ({"num_layers_to_remove": 2}, ["--num-layers-to-remove", "2"]),
    "uidl": ({"num_layers_to_remove": 2}, ["--num-layers-to-remove", "2"]),
    "replaceme": ({"num_layers_to_remove": 2}, ["--num-layers-to-remove", "2"]),
    "greedy_replace": ({"num_layers_to_remove": 2}, ["--num-layers-to-remove", "2"]),
    "auto": ({"num_layers_to_remove": 2}, ["--num-layers-to-remove", "2"]),
    "flattengpt": ({"num_layers_to_remove": 2}, ["--num-layers-to-remove", "2"]),
    "come": ({"num_layers_to_remove": 2}, ["--num-layers-to-remove", "2"]),
    "laco": (
        {"num_layers_to_remove": 2, "threshold": 0.01},
        ["--num-layers-to-remove", "2", "--laco-threshold", "0.01"],
    ),
    "sliding_window": (
        {"num_layers_to_remove": 2, "threshold": 0.01},
        ["--num-layers-to-remove", "2", "--sliding-window-threshold", "0.01"],
    ),
    "ffn_merge": ({"window_size": 2, "num_windows": 1}, ["--window-size", "2", "--num-windows", "1"]),
}
#: LayerCollapse compresses only after its own training verb (`optimum-flatten layer-collapse`, tests/cli).
UNCOVERED = {"layer_collapse"}
CALIBRATION = {"nsamples": 4, "seqlen": 16, "batch_size": 2}


def test_the_matrix_names_every_registered_method():
    assert set(METHODS) | UNCOVERED == set(registered_methods())


@pytest.mark.parametrize("family", sorted(tiny_models.FACTORIES))
def test_every_methods_claim_on_a_save_is_safe_on_every_family(family):
    """A fresh model is nobody's to write: every method answers None, without assuming a dense MLP."""
    model = tiny_models.FACTORIES[family]()
    for name in registered_methods():
        method = get_method_class(name)
        assert method.checkpoint_writer(model) is None, name
        assert method.adopt_reloaded_(model) == [] or method.adopt_reloaded_(model) is None, name


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("\n".join(tiny_models.sample_texts(60)))
    return path


def _dense(family: str, folder):
    """The family's tiny model and a real tokenizer written to `folder`, as a user's checkpoint would be."""
    model = tiny_models.FACTORIES[family]()
    model.save_pretrained(folder)
    tiny_models.tiny_hf_tokenizer().save_pretrained(folder)
    return folder


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _api(dense, method: str, text) -> tuple[torch.nn.Module | None, FlattenQuantizer | None, str | None]:
    """(model, quantizer, None) compressed through the API on what the command line reads, or the API's refusal."""
    model = AutoModelForCausalLM.from_pretrained(dense).eval()
    tokenizer = AutoTokenizer.from_pretrained(dense)
    try:
        config = FlattenConfig(method=method, dataset=str(text), **CALIBRATION, **METHODS[method][0])
        quantizer = FlattenQuantizer(config, progress=False)
        quantizer.compress(model, tokenizer)
    except (ValueError, TypeError, NotImplementedError) as refusal:
        return None, None, str(refusal)
    return model, quantizer, None


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("family", CLI_FAMILIES)
def test_compress_through_the_cli_writes_what_the_api_writes_or_refuses_in_one_line(
    family, method, text, tmp_path, capsys
):
    dense = _dense(family, tmp_path / "dense")
    before = {p.name: p.read_bytes() for p in dense.iterdir()}
    out = tmp_path / "out"
    arguments = ["compress", str(dense), "--method", method, "--dataset", str(text), "--no-progress"]
    arguments += ["--nsamples", "4", "--seqlen", "16", "--batch-size", "2", *METHODS[method][1]]
    code = main([*arguments, "--output", str(out)])
    printed = capsys.readouterr()
    expected, quantizer, refusal = _api(dense, method, text)
    assert {p.name: p.read_bytes() for p in dense.iterdir()} == before  # the source is never touched
    if refusal is not None:
        assert code == 2, f"the API refused ({refusal}) but the command line exited {code}"
        errors = [line for line in printed.err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in printed.err, printed.err[-2000:]
        assert not out.exists()
        return
    assert code == 0, printed.err[-3000:]
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()  # plain transformers, no optimum_flatten hook
    assert type(reloaded) is type(expected)
    torch.testing.assert_close(_logits(reloaded, sample_ids()), _logits(expected, sample_ids()))
    report = json.loads((out / "flatten_report.json").read_text())
    assert report["method"] == quantizer.report["method"] and report["plan"] == quantizer.report["plan"]


@pytest.mark.parametrize("family", sorted(tiny_models.FACTORIES))
def test_the_apis_save_and_push_write_a_plain_checkpoint_on_every_family(family, tmp_path):
    """`FlattenQuantizer.save` and `push_to_hub` (the Hub client replaced at its network boundary) after a layer
    drop, on every family the API compresses (text, images or two stacks)."""
    from test_hub import RecordingApi

    model = tiny_models.FACTORIES[family]()
    if family == "starcoder2":  # no adapter: refused in one line by the registry (tests/adapters)
        pytest.skip("not a supported family")
    options = {"stacks": ["decoder"]} if family == "marian" else {}
    dataset = tiny_models.sample_pixel_values(4) if family == "vit" else tiny_models.sample_texts()
    config = FlattenConfig(method="shortgpt", num_layers_to_remove=2, dataset=dataset, **CALIBRATION, **options)
    quantizer = FlattenQuantizer(config, progress=False)
    quantizer.compress(model, None if family == "vit" else tiny_models.CharTokenizer())
    saved = quantizer.save(model, tmp_path / "saved")
    api = RecordingApi()
    quantizer.push_to_hub(model, "me/flat", local_dir=tmp_path / "pushed", api=api)
    assert {"model.safetensors", "config.json", "flatten_report.json"} <= set(api.uploaded)
    assert api.uploaded["model.safetensors"] == (saved / "model.safetensors").read_bytes()
    # Plain transformers picks the class from the saved config (Baichuan is written as a plain LLaMA checkpoint).
    plain = type(model) if family in ("vit", "marian", "bert", "gemma3") else AutoModelForCausalLM
    reloaded = plain.from_pretrained(saved).eval()
    inputs = {"pixel_values": tiny_models.sample_pixel_values(2)} if family == "vit" else None
    with torch.no_grad():
        if inputs is not None:
            torch.testing.assert_close(reloaded(**inputs).logits, model.eval()(**inputs).logits)
        elif family in ("marian", "bert"):
            assert json.loads((saved / "config.json").read_text())["model_type"] == model.config.model_type
        else:
            torch.testing.assert_close(_logits(reloaded, sample_ids()), _logits(model.eval(), sample_ids()))


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_compress_on_load_gives_the_apis_model(family, text, tmp_path):
    dense = _dense(family, tmp_path / "dense")
    config = FlattenConfig(method="shortgpt", dataset=str(text), **CALIBRATION, num_layers_to_remove=2)
    loaded = AutoModelForCausalLM.from_pretrained(dense, quantization_config=copy.deepcopy(config)).eval()
    expected, _, refusal = _api(dense, "shortgpt", text)
    assert refusal is None
    torch.testing.assert_close(_logits(loaded, sample_ids()), _logits(expected, sample_ids()))


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_compress_reload_evaluate_recover_through_the_cli(family, text, tmp_path, capsys):
    dense = _dense(family, tmp_path / "dense")
    compressed, healed = tmp_path / "compressed", tmp_path / "healed"
    common = ["--dataset", str(text), "--seqlen", "16", "--no-progress"]
    assert main(["compress", str(dense), "--method", "shortgpt", "--num-layers-to-remove", "2", *common,
                 "--nsamples", "4", "--output", str(compressed)]) == 0  # fmt: skip
    layers = AutoModelForCausalLM.from_pretrained(compressed).config.get_text_config(decoder=True).num_hidden_layers
    assert layers == 4
    measurements = tmp_path / "eval.json"
    assert main(["evaluate", str(compressed), "--baseline", str(dense), *common, "--max-tokens", "128",
                 "--no-speed", "--json", str(measurements)]) == 0  # fmt: skip
    models = json.loads(measurements.read_text())["models"]
    assert [m["layers"] for m in models] == [6, 4] and models[1]["fidelity"]["kl"] > 0
    assert main(["recover", str(compressed), "--teacher", str(dense), *common, "--max-steps", "1",
                 "--per-device-train-batch-size", "2", "--output", str(healed)]) == 0  # fmt: skip
    report = json.loads((healed / "flatten_report.json").read_text())
    assert report["recovery"]["steps"] == 1 and report["recovery"]["loss"] == "distillation"
    reloaded = AutoModelForCausalLM.from_pretrained(healed).eval()
    assert reloaded.config.get_text_config(decoder=True).num_hidden_layers == 4
    assert torch.isfinite(_logits(reloaded, sample_ids())).all()
    capsys.readouterr()


@pytest.mark.parametrize(("family", "reason"), [("starcoder2", "no adapter"), ("vit", "images")])
def test_what_the_cli_cannot_compress_is_refused_in_one_line_before_anything_is_written(
    family, reason, text, tmp_path, capsys
):
    dense = _dense(family, tmp_path / "dense")
    out = tmp_path / "out"
    arguments = ["compress", str(dense), "--method", "shortgpt", "--num-layers-to-remove", "2", "--dataset", str(text)]
    assert main([*arguments, "--nsamples", "4", "--seqlen", "16", "--output", str(out), "--no-progress"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and reason in errors[0] and not out.exists()


@pytest.mark.parametrize("verb", ["compress", "evaluate", "recover", "layer-collapse", "demo"])
def test_flags_shared_by_the_verbs_are_accepted_by_each_where_they_mean_something(verb, capsys):
    """--no-progress everywhere; --trust-remote-code wherever a model is loaded; --overwrite and --seed wherever the
    verb writes a checkpoint or draws at random."""
    from optimum_flatten.cli.main import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if a.dest == "verb" or (getattr(a, "choices", None) and verb in a.choices))
    flags = {option for action in verbs.choices[verb]._actions for option in action.option_strings}
    expected = {"--no-progress"}
    expected |= {"--trust-remote-code"} if verb != "demo" else set()
    expected |= {"--overwrite", "--seed"} if verb in ("compress", "recover", "layer-collapse") else set()
    expected |= {"--overwrite"} if verb == "demo" else set()
    assert expected <= flags, sorted(expected - flags)


def _marian_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, decoder_input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize(
    ("stacks", "method"),
    [(["decoder"], "shortgpt"), (["encoder"], "shortgpt"), (["encoder", "decoder"], "ffn_merge")],
)
def test_marian_compresses_through_the_cli_with_stacks_as_through_the_api(stacks, method, text, tmp_path, capsys):
    """``--stacks`` is the command line's spelling of ``FlattenConfig(stacks=...)``: without it a translation
    model, whose two stacks the API asks the user to choose between, could not be compressed from the shell."""
    from transformers import MarianMTModel

    dense = _dense("marian", tmp_path / "dense")
    options, flags = METHODS[method]
    if len(stacks) > 1:  # both stacks at once: ffn_merge's paper setting, scored by the cosine of final states
        options = {**options, "sync_stacks": True, "selection": "cosine"}
        flags = [*flags, "--sync-stacks", "true", "--ffn-merge-selection", "cosine"]
    out = tmp_path / "out"
    arguments = ["compress", str(dense), "--method", method, "--dataset", str(text), "--no-progress", *flags]
    arguments += ["--nsamples", "4", "--seqlen", "16", "--batch-size", "2", "--stacks", *stacks]
    assert main([*arguments, "--output", str(out)]) == 0, capsys.readouterr().err[-3000:]
    expected = MarianMTModel.from_pretrained(dense).eval()
    config = FlattenConfig(method=method, dataset=str(text), stacks=stacks, **CALIBRATION, **options)
    quantizer = FlattenQuantizer(config, progress=False)
    quantizer.compress(expected, AutoTokenizer.from_pretrained(dense))
    reloaded = MarianMTModel.from_pretrained(out).eval()
    dense_config = MarianMTModel.from_pretrained(dense).config
    report = json.loads((out / "flatten_report.json").read_text())
    if method == "ffn_merge":  # shares the windows' FFNs in every stack named, the layers stay
        assert sorted({group["stack"] for group in report["ffn_groups"]}) == sorted(stacks)
    for stack in ("encoder", "decoder") if method != "ffn_merge" else ():
        layers = len(getattr(reloaded.model, stack).layers)
        full = dense_config.encoder_layers if stack == "encoder" else dense_config.decoder_layers
        assert (layers < full) == (stack in stacks), (stack, layers, full)
    torch.testing.assert_close(_marian_logits(reloaded, sample_ids()), _marian_logits(expected, sample_ids()))
    assert report["plan"] == quantizer.report["plan"]


@pytest.mark.parametrize("family", ["bert", "marian"])
def test_recover_refuses_what_is_no_causal_lm_in_one_line_before_anything_loads_or_is_written(
    family, text, tmp_path, capsys
):
    """`AutoModelForCausalLM` would load BERT as a BertLMHeadModel and Marian as a decoder without its encoder, and
    healing would train them as what they are not: the command, the API and compress-then-heal refuse instead."""
    from optimum_flatten.recovery import RecoveryConfig, recover

    dense = _dense(family, tmp_path / "dense")
    out = tmp_path / "healed"
    code = main(["recover", str(dense), "--teacher", str(dense), "--dataset", str(text), "--seqlen", "16",
                 "--max-steps", "1", "--no-progress", "--output", str(out)])  # fmt: skip
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "causal language models" in errors[0] and not out.exists()
    model = tiny_models.FACTORIES[family]()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match="causal language models"):
        recover(model, tiny_models.tiny_hf_tokenizer(), [str(text)], RecoveryConfig(max_steps=1, seqlen=16))
    stacks = {"stacks": ["decoder"]} if family == "marian" else {}
    config = FlattenConfig(
        method="shortgpt", num_layers_to_remove=2, dataset=tiny_models.sample_texts(), heal=8, **CALIBRATION, **stacks
    )
    with pytest.raises(ValueError, match="causal language models"):
        FlattenQuantizer(config, progress=False).compress(model, tiny_models.CharTokenizer())
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
