"""What each mode trains, the gate, plain reloads, and the refusals of bad input (before any weight changes)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import tiny_models
from common import assert_close, compress, logits, sample_ids, tiny_recovery_config
from optimum_flatten.export.model_card import render_model_card
from optimum_flatten.options.recovery import SWEPT_WEIGHT_SCALE
from optimum_flatten.recovery import RecoveryConfig, recover
from optimum_flatten.recovery.distill import LossParts
from optimum_flatten.recovery.gate import KEPT_INPUT, HeldOutGate
from optimum_flatten.recovery.selection import changed_parameter_names


def _config(**overrides) -> RecoveryConfig:
    return tiny_recovery_config(**{"learning_rate": 1e-2, **overrides})


def test_changed_trains_merged_blocks_and_bridged_projections_and_nothing_else(compressed):
    dense, model, report = compressed
    model = copy.deepcopy(model)
    names = changed_parameter_names(model, report)
    merged = [k for k, g in enumerate(report["plan"]["groups"]) if len(g) > 1]
    bridged = [m["output_layer"] for m in report["linear_replacement"]["maps"]]
    assert merged == [0, 2] and bridged
    assert all(n.startswith(tuple(f"model.layers.{k}." for k in merged + bridged)) for n in names)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    healed, log = recover(
        model,
        tiny_models.CharTokenizer(),
        tiny_models.sample_texts(),
        _config(mode="changed"),
        teacher=dense,
        report=report,
    )
    assert log["mode"] == "changed" and log["steps"] == 4 and log["tokens_trained"] == 256
    assert log["mode_chosen"] == "given"
    for name, tensor in healed.state_dict().items():
        assert torch.equal(tensor, before[name]) == (name not in names), name
    assert all(p.requires_grad for p in healed.parameters())  # the flags are given back as they were


def test_gate_reverts_to_the_input_weights_when_training_only_makes_it_worse(compressed):
    dense, model, report = compressed
    model = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = _config(mode="full", learning_rate=50.0, heldout_rows=4, eval_every=1, patience=2)
    healed, log = recover(
        model, tiny_models.CharTokenizer(), tiny_models.sample_texts(), config, teacher=dense, report=report
    )
    assert log["gate"] == KEPT_INPUT and log["best_step"] == 0
    assert log["steps"] == 2  # stopped early after `patience` evaluations without improvement
    assert log["heldout_after"] == log["heldout_before"]
    assert all(torch.equal(v, before[k]) for k, v in healed.state_dict().items())


def test_gate_keeps_the_best_state_and_loads_it_back():
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(5.0)

    def loss(m, _batch):
        value = (m.weight[0, 0] - 1.0) ** 2
        return LossParts(value, 0.0, float(value), 0.0, 1)

    rows = [{"input_ids": torch.zeros(2, dtype=torch.long)}]
    gate = HeldOutGate(model, loss, rows, eval_every=1, patience=2, batch_size=1)
    stops = []
    for step, weight in enumerate([3.0, 1.5, 4.0, 0.0], start=1):
        with torch.no_grad():
            model.weight.fill_(weight)
        stops.append(gate.evaluate(step))
    assert stops == [False, False, False, True]
    assert gate.restore_best_() == "kept the best trained state" and gate.best_step == 2
    assert float(model.weight.detach()) == 1.5


@pytest.mark.parametrize("mode", ["lora", "changed", "last_k", "full"])
def test_every_mode_saves_a_checkpoint_plain_transformers_reloads(compressed, tmp_path, mode):
    dense, model, report = compressed
    config = _config(mode=mode, max_tokens=128, last_k=1, hidden_weight=0.5, heldout_rows=2)
    healed, log = recover(
        copy.deepcopy(model),
        tiny_models.CharTokenizer(),
        tiny_models.sample_texts(),
        config,
        teacher=dense,
        report=report,
    )
    assert type(healed).__name__ == "LlamaForCausalLM" and log["mode"] == mode
    assert not any("lora" in k for k in healed.state_dict())
    healed.save_pretrained(tmp_path / mode)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / mode)
    assert reloaded.config.num_hidden_layers == 4
    assert reloaded.config.use_cache is model.config.use_cache is True  # the Trainer had set it to False
    assert_close(logits(reloaded, sample_ids()), logits(healed, sample_ids()))


def _refused(model, message, **kwargs) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = sorted(n for n, _ in model.named_modules())
    with pytest.raises(ValueError, match=message):
        recover(model, tiny_models.CharTokenizer(), tiny_models.sample_texts(), **kwargs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert sorted(n for n, _ in model.named_modules()) == names  # no adapter was injected


def test_bad_input_is_refused_before_any_change(compressed, tmp_path):
    dense, model, _report = compressed
    model = copy.deepcopy(model)
    _refused(model, "unknown recovery mode 'everything'", config=_config(mode="everything"), teacher=dense)
    other = tiny_models._build(
        tiny_models.LlamaConfig(**tiny_models._common(vocab_size=tiny_models.VOCAB + 32)), seed=0
    )
    _refused(model, "vocabulary has 128 entries and the student's 96", config=_config(), teacher=other)
    _refused(model, "need the layer map", config=_config(hidden_weight=1.0), teacher=dense, report=None)
    _refused(model, "max_tokens=1000000 needs", config=_config(max_tokens=1_000_000), teacher=dense)
    _refused(
        model,
        "nothing the compression changed",
        config=_config(mode="changed"),
        teacher=dense,
        report={"plan": {"groups": [[0], [1], [4], [5]], "num_layers": 6}},
    )
    folder = tmp_path / "teacher"
    dense.save_pretrained(folder)
    tiny_models.tiny_hf_tokenizer().save_pretrained(folder)
    _refused(model, "tokenizer encodes the training text differently", config=_config(), teacher=str(folder))
    # With no training text (the teacher writes it), the tokenizers are compared on a probe text.
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="tokenizer encodes a probe text differently"):
        recover(model, tiny_models.CharTokenizer(), "teacher", _config(), teacher=str(folder))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_teacher_that_cannot_be_the_dense_model_is_refused_before_any_change(compressed):
    """Review J: the compressed model as its own teacher, the two given the other way round, and in mode 'local' a
    teacher of another depth than the plan's were healed towards (a warning at most)."""
    dense, model, report = compressed
    model = copy.deepcopy(model)
    _refused(model, "the teacher is the model being healed", config=_config(), teacher=copy.deepcopy(model))
    swapped = copy.deepcopy(dense)
    _refused(swapped, "the teacher has 4 layers, fewer than the 6", config=_config(), teacher=model, report=None)
    config = tiny_models.LlamaConfig(**tiny_models._common(num_key_value_heads=2, num_hidden_layers=4))
    shallow = tiny_models._build(config, seed=3)  # the student's depth, not the plan's 6
    _refused(model, "maps the model's blocks onto 6 original layers", config=_config(mode="local"), teacher=shallow,
             report=report)  # fmt: skip


def test_each_mode_takes_its_measured_learning_rate_unless_one_is_given():
    """A full fine-tune at LoRA's rate (1e-4) or a local block at full fine-tuning's would be a default nobody
    measured: the rate follows the mode, and the one given wins."""
    from optimum_flatten.options.recovery import DEFAULT_LEARNING_RATES, RecoveryConfig

    assert {m: RecoveryConfig(mode=m).rate for m in DEFAULT_LEARNING_RATES} == {
        "lora": 1e-4,
        "local": 1e-3,
        "changed": 2e-4,
        "last_k": 2e-4,
        "full": 6e-5,
    }
    assert RecoveryConfig(mode="full", learning_rate=3e-4).rate == 3e-4


def test_the_default_mode_is_full_where_it_fits_then_local_with_a_teacher_and_a_plan_on_one_process_else_lora():
    from optimum_flatten.options.recovery import default_mode

    assert default_mode(has_teacher=True, has_plan=True, processes=1) == "local"
    assert default_mode(has_teacher=True, has_plan=True, processes=1, full_fits=True) == "full"
    assert default_mode(has_teacher=True, has_plan=False, processes=1, full_fits=True) == "full"
    for teacher, plan, processes in [(False, True, 1), (True, False, 1), (True, False, 2), (False, True, 2)]:
        assert default_mode(has_teacher=teacher, has_plan=plan, processes=processes) == "lora"
    assert default_mode(has_teacher=False, has_plan=True, processes=1, full_fits=True) == "lora"
    assert default_mode(has_teacher=True, has_plan=True, processes=2, fsdp=True) == "full"


def test_several_processes_pick_the_mode_one_process_would_or_full_sharded_where_that_is_local():
    """Never LoRA where one process would train `full` or `local`: `full` where it fits every rank, and where it
    does not, `full` sharded with FSDP2 (the nearest mode to `local` that runs across ranks), said in the config."""
    from optimum_flatten.options.recovery import FSDP2_ARGS, default_mode, with_mode

    assert default_mode(has_teacher=True, has_plan=True, processes=2, full_fits=True) == "full"
    assert default_mode(has_teacher=True, has_plan=True, processes=2) == "full"
    fits = with_mode(RecoveryConfig(max_tokens=1000), True, True, processes=2, full_fits=lambda: True, merged=True)
    assert (fits.mode, fits.local_then_global_tokens, fits.extra_training_args) == ("full", None, {})
    sharded = with_mode(RecoveryConfig(), True, True, processes=2, full_fits=lambda: False)
    assert (sharded.mode, sharded.extra_training_args) == ("full", FSDP2_ARGS)
    own = RecoveryConfig(extra_training_args={"fsdp": False})  # the user's own training arguments win
    assert with_mode(own, True, True, processes=2, full_fits=lambda: False).extra_training_args["fsdp"] is False
    assert with_mode(RecoveryConfig(), True, False, processes=2, full_fits=lambda: False).mode == "lora"


def test_with_mode_asks_whether_full_fits_only_where_the_answer_can_change_the_mode():
    from optimum_flatten.options.recovery import with_mode

    def never() -> bool:
        raise AssertionError("asked")

    config = RecoveryConfig()
    assert with_mode(config, has_teacher=False, has_plan=True, processes=1, full_fits=never).mode == "lora"
    assert with_mode(config, has_teacher=False, has_plan=True, processes=2, full_fits=never).mode == "lora"
    assert with_mode(config, True, True, processes=2, fsdp=True, full_fits=never).mode == "full"
    assert with_mode(RecoveryConfig(mode="lora"), True, True, processes=1, full_fits=never).mode == "lora"
    assert with_mode(config, True, True, processes=1, full_fits=lambda: True).mode == "full"
    assert with_mode(config, True, True, processes=1, full_fits=lambda: False).mode == "local"


def test_a_default_full_after_a_plan_that_merged_layers_splits_the_budget_between_local_and_global():
    from optimum_flatten.options.recovery import merges_layers, with_mode

    assert merges_layers({"groups": [[0, 1], [2], [3]]}) and not merges_layers({"groups": [[0], [2], [3]]})
    assert not merges_layers(None) and not merges_layers({})
    fits = lambda: True  # noqa: E731
    split = with_mode(RecoveryConfig(max_tokens=1001), True, True, processes=1, full_fits=fits, merged=True)
    assert (split.mode, split.max_tokens, split.local_then_global_tokens) == ("local", 501, 500)
    # Kept as they were: no merged layers, a mode or a second phase given, no token budget, FSDP, full not fitting.
    assert with_mode(RecoveryConfig(max_tokens=1000), True, True, processes=1, full_fits=fits).mode == "full"
    given = RecoveryConfig(mode="full", max_tokens=1000)
    assert with_mode(given, True, True, processes=1, full_fits=fits, merged=True) is given
    phases = RecoveryConfig(max_tokens=1000, local_then_global_tokens=10)
    kept = with_mode(phases, True, True, processes=1, full_fits=fits, merged=True)
    assert (kept.mode, kept.max_tokens, kept.local_then_global_tokens) == ("full", 1000, 10)
    assert with_mode(RecoveryConfig(), True, True, processes=1, full_fits=fits, merged=True).mode == "full"
    fsdp = with_mode(RecoveryConfig(max_tokens=1000), True, True, processes=2, fsdp=True, merged=True)
    assert (fsdp.mode, fsdp.local_then_global_tokens) == ("full", None)
    alone = with_mode(RecoveryConfig(max_tokens=1000), True, True, processes=1, full_fits=lambda: False, merged=True)
    assert (alone.mode, alone.max_tokens, alone.local_then_global_tokens) == ("local", 1000, None)


@pytest.mark.parametrize(
    ("method", "free", "mode"),
    [("replaceme", 2**50, "full"), ("flattengpt", 2**50, "local then global"), ("flattengpt", 2**10, "local")],
)
def test_recover_defaults_to_full_where_its_memory_fits_and_to_local_where_it_does_not(
    compressed, monkeypatch, method, free, mode
):
    """Where `full` fits it is the default, except after a plan that merged layers (FlattenGPT's pairs), where the
    budget is split between `local` and the global loss on the same blocks (`options.recovery.local_then_global`);
    where it does not fit, `local`."""
    from optimum_flatten.recovery import footprint

    monkeypatch.setattr(footprint, "available_bytes", lambda device: free)
    dense, model, report = compressed
    if method == "replaceme":  # one bridged block, no merged layers
        model = copy.deepcopy(dense)
        report = dict(compress(model, "replaceme", num_layers_to_remove=2).report)
        assert not any(len(g) > 1 for g in report["plan"]["groups"])
    config = _config(learning_rate=None, max_tokens=64)  # the mode and its learning rate left to the defaults
    _, log = recover(
        copy.deepcopy(model),
        tiny_models.tiny_hf_tokenizer(),
        tiny_models.sample_texts(),
        config,
        teacher=copy.deepcopy(dense),
        report=report,
    )
    rate = {"full": 6e-5, "local": 1e-3, "local then global": 1e-3}[mode]
    assert log["mode"] == mode.split()[0]
    verdict = {"full": "fits within 90% of it)", "local": "does not fit within 90% of it)"}.get(
        mode, "fits within 90% of it); the plan merged layers: local, then the global loss, half the budget each"
    )
    chosen = log["mode_chosen"]
    assert chosen.startswith("the default (full healing adds about") and chosen.endswith(verdict)
    assert log["learning_rate"] == pytest.approx(rate * log["weight_scale"] / SWEPT_WEIGHT_SCALE, rel=1e-12)
    assert ("global_phase" in log) == (mode == "local then global")


def test_recover_without_a_teacher_defaults_to_lora_on_the_lm_loss_whatever_memory_is_free(compressed, monkeypatch):
    from optimum_flatten.recovery import footprint

    monkeypatch.setattr(footprint, "available_bytes", lambda device: 2**50)
    _, model, report = compressed
    _, log = recover(
        copy.deepcopy(model),
        tiny_models.tiny_hf_tokenizer(),
        tiny_models.sample_texts(),
        _config(learning_rate=None, max_tokens=64),
        teacher=False,
        report=report,
    )
    assert (log["mode"], log["loss"], log["learning_rate"]) == ("lora", "lm", 1e-4)
    assert log["mode_chosen"] == "the default"  # no teacher: the memory was not asked


@pytest.mark.parametrize("mode", ["full", "last_k", "local_then_all"])
def test_frozen_embeddings_leave_the_token_table_and_the_lm_head_bit_identical(compressed, mode):
    """`train_embeddings=False`: the input embedding and the (untied) LM head keep their bits in every mode that
    would train them; everything else that mode trains still moves, and the log and the card say so."""
    dense, model, report = compressed
    model = copy.deepcopy(model)
    tables = {"model.embed_tokens.weight", "lm_head.weight"}
    assert tables <= {name for name, _ in model.named_parameters()}  # untied here: two tables
    options = {"mode": mode, "last_k": 2}
    if mode == "local_then_all":
        options = {"mode": "local", "max_tokens": 64, "local_then_global_tokens": 128, "global_scope": "all"}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    healed, log = recover(
        model,
        tiny_models.CharTokenizer(),
        tiny_models.sample_texts(),
        _config(train_embeddings=False, **options),
        teacher=dense,
        report=report,
    )
    after = dict(healed.named_parameters())
    moved = {name for name in before if not torch.equal(after[name], before[name])}
    assert not moved & tables
    if mode == "last_k":
        assert moved and all(n.startswith(("model.layers.2.", "model.layers.3.", "model.norm.")) for n in moved)
    else:  # every other parameter trained (the global phase of the split reaches them all)
        assert moved == set(before) - tables
    assert log["embeddings"].startswith("frozen") and all(p.requires_grad for p in healed.parameters())
    assert "the token embeddings and the LM head were not trained" in render_model_card({**report, "recovery": log})


def test_without_embeddings_drops_a_tied_table_once_and_both_untied_ones():
    from optimum_flatten.recovery.selection import without_embeddings

    for model, dropped in (
        (tiny_models.tiny_llama_gqa(), {"model.embed_tokens.weight", "lm_head.weight"}),
        (tiny_models.tiny_gemma3_text(), {"model.embed_tokens.weight"}),
    ):
        names = [name for name, _ in model.named_parameters()]
        assert set(names) - set(without_embeddings(model, names)) == dropped
        assert without_embeddings(model, names[:3]) == [n for n in names[:3] if n not in dropped]


@pytest.mark.parametrize("train_embeddings", [None, True])
def test_the_default_trains_full_with_frozen_embeddings_where_only_that_fits(compressed, monkeypatch, train_embeddings):
    """With memory between `full`'s footprint with and without the embeddings' state, the default mode is `full`
    with the token table and the LM head frozen (the log and the card say why); asked to train them with AdamW (an
    optimiser given: no lean fallback), it is `local`."""
    from optimum_flatten.recovery import footprint

    dense = compressed[0]
    model = copy.deepcopy(dense)
    report = dict(compress(model, "replaceme", num_layers_to_remove=2).report)  # no merged layers: full stays full
    adamw = {"disable_tqdm": True, "optim": "adamw_torch"}
    config = _config(learning_rate=None, max_tokens=64, train_embeddings=train_embeddings, extra_training_args=adamw)
    trained, frozen = (
        footprint.full_footprint(model, RecoveryConfig(**{**vars(config), "train_embeddings": t})).total
        for t in (True, False)
    )
    assert frozen < trained
    monkeypatch.setattr(footprint, "available_bytes", lambda device: (trained + frozen) / 2 / footprint.HEADROOM)
    table = model.get_input_embeddings().weight.detach().clone()
    healed, log = recover(
        model,
        tiny_models.tiny_hf_tokenizer(),
        tiny_models.sample_texts(),
        config,
        teacher=copy.deepcopy(dense),
        report=report,
    )
    if train_embeddings is None:
        assert log["mode"] == "full" and log["embeddings"].startswith("frozen")
        assert (
            "does not fit" in log["mode_chosen"]
            and "with the token embeddings and the LM head frozen" in (log["mode_chosen"])
        )
        assert log["mode_chosen"].endswith("fits within 90% of it)")
        assert torch.equal(healed.get_input_embeddings().weight, table)
    else:
        assert log["mode"] == "local" and "embeddings" not in log
        assert log["mode_chosen"].endswith("does not fit within 90% of it)")


def test_where_adamw_does_not_fit_full_trains_with_adafactor_before_falling_back_to_local(compressed, monkeypatch):
    """With memory between `full`'s footprint under Adafactor and under AdamW (embeddings frozen too), the default
    is `full` with ``optim="adafactor"``, said in the log; with less than Adafactor needs, `local`."""
    from optimum_flatten.recovery import footprint

    dense = compressed[0]
    model = copy.deepcopy(dense)
    report = dict(compress(model, "replaceme", num_layers_to_remove=2).report)
    config = _config(learning_rate=None, max_tokens=64, train_embeddings=True)
    sized = {
        optim: footprint.full_footprint(
            model, RecoveryConfig(**{**vars(config), "extra_training_args": {"optim": optim}})
        ).total
        for optim in ("adamw_torch", "adafactor")
    }
    assert sized["adafactor"] < sized["adamw_torch"]
    between = (sized["adamw_torch"] + sized["adafactor"]) / 2 / footprint.HEADROOM
    monkeypatch.setattr(footprint, "available_bytes", lambda device: between)
    choice = footprint.ModeChoice(model, config, lambda: 0)
    assert choice() and choice.optimiser == "adafactor" and not choice.freezes_embeddings
    assert "with adafactor" in choice.line and choice.line.endswith("fits within 90% of it")
    _, log = recover(
        model, tiny_models.tiny_hf_tokenizer(), tiny_models.sample_texts(), config, teacher=copy.deepcopy(dense),
        report=report,
    )  # fmt: skip
    assert log["mode"] == "full" and log["optimizer"] == "adafactor" and "with adafactor" in log["mode_chosen"]
    monkeypatch.setattr(footprint, "available_bytes", lambda device: sized["adafactor"] / 2)
    choice = footprint.ModeChoice(model, config, lambda: 0)
    assert not choice() and choice.optimiser is None


def test_a_budget_that_is_not_whole_steps_says_how_many_tokens_train(compressed, caplog):
    """A step reads a whole batch (2 rows of 32 here), so 100 tokens train 128: the log says so, and a budget of
    whole steps says nothing."""
    dense, model, report = compressed
    rounded_up = "max_tokens=100 rounds up to 2 whole steps of 64 tokens: 128 tokens train."
    for tokens, said in ((100, rounded_up), (128, None)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="optimum_flatten.recovery.arguments"):
            _, log = recover(
                copy.deepcopy(model),
                tiny_models.CharTokenizer(),
                tiny_models.sample_texts(),
                _config(mode="full", max_tokens=tokens),
                teacher=dense,
                report=report,
            )
        rounded = [r.getMessage() for r in caplog.records if "rounds up" in r.getMessage()]
        assert rounded == ([said] if said else [])
        assert log["tokens_trained"] == 128


def test_the_ranks_of_a_cpu_launch_share_the_hosts_memory(compressed, monkeypatch):
    """Each rank of a CPU launch trains its own copy in one memory: `full` must fit the host's free memory divided
    by the processes on it (torchrun's ``LOCAL_WORLD_SIZE``), not the whole of it on every rank."""
    from optimum_flatten.recovery import footprint

    model = copy.deepcopy(compressed[0])
    config = _config(learning_rate=None, max_tokens=64, train_embeddings=True)
    needed = footprint.full_footprint(model, config).total
    monkeypatch.setattr(footprint, "available_bytes", lambda device: int(needed / footprint.HEADROOM * 1.5))
    assert footprint.ModeChoice(model, config, lambda: 0)()  # one process: fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    choice = footprint.ModeChoice(model, config, lambda: 0)
    assert not choice() and "this rank's share of the host's memory: 2 processes" in choice.line
