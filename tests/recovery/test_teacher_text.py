"""Healing on text the teacher samples itself (`recovery.teacher_text`): the rows, their seed, the sampling's
settings, the cache, the share of a mix, the gate's parts, the refusals and the command line."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

import tiny_models
from common import SMALL_HEALING as SMALL
from common import compress, dense_and_compressed_on_disk
from optimum_flatten.cli.main import main
from optimum_flatten.options.recovery import RecoveryConfig
from optimum_flatten.recovery import recover
from optimum_flatten.recovery.footprint import full_footprint
from optimum_flatten.recovery.rows import UNGUARDED_NOTE
from optimum_flatten.recovery.teacher_text import (
    MAX_BATCH_SIZE,
    generation_config,
    heldout_split,
    kv_cache_bytes,
    sample_teacher_rows,
    sampling_batch_size,
)
from optimum_flatten.recovery.text_repetition import describe, repetition_summary
from optimum_flatten.recovery.trainer import _teacher_rows

TOKENIZER = tiny_models.CharTokenizer()


def _ids(rows):
    return torch.stack([row["input_ids"] for row in rows])


def _counting(model):
    """`model` with its generate calls counted (in ``model.generate_calls``)."""
    model.generate_calls = 0
    original = model.generate

    def generate(*args, **kwargs):
        model.generate_calls += 1
        return original(*args, **kwargs)

    model.generate = generate
    return model


def test_rows_are_seqlen_tokens_from_bos_labelled_and_reproducible_by_seed():
    teacher = tiny_models.tiny_llama_gqa()
    rows, record = sample_teacher_rows(teacher, TOKENIZER, 5, 24, seed=3, batch_size=2, progress=False)
    ids = _ids(rows)
    assert ids.shape == (5, 24) and (ids[:, 0] == TOKENIZER.bos_token_id).all()
    for row in rows:
        assert torch.equal(row["labels"], row["input_ids"]) and bool(row["attention_mask"].all())
    assert record["rows"] == 5 and record["tokens"] == 120 and record["cached"] is False
    assert record["start"] == "bos" and record["temperature"] == 1.0 and record["top_k"] is None
    assert record["peak_memory_bytes"] > 0 and record["seconds"] >= 0
    assert record["excerpts"] == []  # this tokenizer cannot decode
    assert record["repetition"] == repetition_summary(ids, skip=1)  # what the teacher wrote after its start token
    # The same seed gives the same rows whatever the process's random state did in between.
    torch.manual_seed(1234)
    torch.rand(100)
    again, _ = sample_teacher_rows(teacher, TOKENIZER, 5, 24, seed=3, batch_size=2, progress=False)
    assert torch.equal(_ids(again), ids)
    other, _ = sample_teacher_rows(teacher, TOKENIZER, 5, 24, seed=4, batch_size=2, progress=False)
    held, _ = sample_teacher_rows(teacher, TOKENIZER, 5, 24, seed=3, batch_size=2, progress=False, stream="heldout")
    assert not torch.equal(_ids(other), ids) and not torch.equal(_ids(held), ids)


def test_the_record_quotes_what_the_teacher_wrote():
    """The first tokens of the first rows, decoded, so that a person reads in the log what healing trained on."""
    tokenizer = tiny_models.tiny_hf_tokenizer()
    rows, record = sample_teacher_rows(tiny_models.tiny_llama_gqa(), tokenizer, 3, 60, seed=0, progress=False)
    expected = [tokenizer.decode(row["input_ids"][:48].tolist(), skip_special_tokens=True) for row in rows[:2]]
    assert record["excerpts"] == expected and all(expected)


def test_no_top_k_or_top_p_applies_whatever_the_models_generation_config_says():
    """The teacher's generation_config.json (here: top_k=1, a near-greedy cut) must not narrow the samples: the
    config generate actually uses has no cut, and the rows differ (with top_k=1 they would all be the greedy one)."""
    teacher = tiny_models.tiny_llama_gqa()
    teacher.generation_config.top_k, teacher.generation_config.top_p = 1, 0.1
    teacher.generation_config.temperature = 0.05
    used = []
    prepare = teacher._prepare_generation_config

    def spy(*args, **kwargs):
        config, model_kwargs = prepare(*args, **kwargs)
        used.append(config)
        return config, model_kwargs

    teacher._prepare_generation_config = spy
    rows, _ = sample_teacher_rows(teacher, TOKENIZER, 6, 16, seed=0, batch_size=6, progress=False)
    config = used[-1]
    assert (config.top_k, config.top_p, config.temperature, config.do_sample) == (0, 1.0, 1.0, True)
    assert config.eos_token_id is None and config.min_p is None and config.use_cache
    assert len({tuple(r.tolist()) for r in _ids(rows)}) == 6
    # The cut is there when asked for: top_k=1 from the same start gives one row six times.
    cut, record = sample_teacher_rows(teacher, TOKENIZER, 6, 16, seed=0, top_k=1, batch_size=6, progress=False)
    assert len({tuple(r.tolist()) for r in _ids(cut)}) == 1 and record["top_k"] == 1
    explicit = generation_config(16, 1, 1.0, None, None, 0)
    assert (explicit.top_k, explicit.top_p, explicit.min_new_tokens, explicit.max_new_tokens) == (0, 1.0, 15, 15)


def test_eos_neither_stops_a_row_nor_is_suppressed():
    teacher = tiny_models.tiny_llama_gqa()
    with torch.no_grad():
        teacher.lm_head.weight[TOKENIZER.eos_token_id] = 50 * teacher.model.norm.weight.sign()  # EOS nearly always
    rows, _ = sample_teacher_rows(teacher, TOKENIZER, 3, 20, seed=0, progress=False)
    ids = _ids(rows)
    assert ids.shape == (3, 20) and (ids[:, 1:] == TOKENIZER.eos_token_id).float().mean() > 0.5


def test_prompts_start_the_rows_with_the_first_tokens_of_each_document(tmp_path):
    teacher = tiny_models.tiny_llama_gqa()
    path = tmp_path / "prompts.txt"
    path.write_text("the state of the union is strong\n\nshort\npeace and work for the people\n")
    rows, record = sample_teacher_rows(teacher, TOKENIZER, 4, 20, seed=0, prompts=str(path), prompt_tokens=6,
                                       progress=False)  # fmt: skip
    starts = {tuple(TOKENIZER(text)["input_ids"][:6]) for text in ("the state of", "peace and work")}
    assert record["start"] == "prompts" and record["prompt_tokens"] == 6
    for row in _ids(rows):
        assert row[0] == TOKENIZER.bos_token_id and tuple(row[1:7].tolist()) in starts
    assert {tuple(r[1:7].tolist()) for r in _ids(rows)} == starts  # both cycled, "short" (too short) left out
    assert record["repetition"] == repetition_summary(_ids(rows), skip=7)  # the prompts repeat each other: skipped


#: A ChatML template, as Qwen2.5's and SmolLM2's tokenizers carry one (with a default system turn).
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nbe brief<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chat_tokenizer():
    tokenizer = tiny_models.tiny_hf_tokenizer()
    tokenizer.chat_template = CHATML
    return tokenizer


def test_a_chat_start_opens_the_assistants_turn_after_the_template_and_its_prompt(tmp_path):
    """`start="chat"`: each row is the template's user turn holding the prompt (empty without one), then the
    assistant's turn the teacher writes; the rendered template, tokenised, is each row's beginning."""
    tokenizer = _chat_tokenizer()
    teacher = tiny_models.tiny_llama_gqa()

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    bare = encode(tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True,
                                                tokenize=False))  # fmt: skip
    rows, record = sample_teacher_rows(teacher, tokenizer, 3, len(bare) + 8, seed=0, start="chat", progress=False)
    assert record["start"] == "chat" and record["start_tokens"]
    for row in _ids(rows):
        assert row[: len(bare)].tolist() == bare

    path = tmp_path / "prompts.txt"
    path.write_text("the state of the union is strong\n")
    rows, record = sample_teacher_rows(teacher, tokenizer, 2, len(bare) + 14, seed=0, start="chat",
                                       prompts=str(path), prompt_tokens=4, progress=False)  # fmt: skip
    # A character-level tokenizer: the prompt's first 4 tokens are the text "the ", and the template rendered
    # around it tokenises to the same ids as its parts.
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "the "}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    assert record["start"] == "chat" and record["prompt_tokens"] == 4
    for row in _ids(rows):
        assert row[: len(bare) + 4].tolist() == encode(rendered)


def test_a_chat_start_without_a_chat_template_is_refused_in_one_line():
    from optimum_flatten.utils.errors import CalibrationDataError

    with pytest.raises(CalibrationDataError, match="needs a tokenizer with a chat template") as refused:
        sample_teacher_rows(tiny_models.tiny_llama_gqa(), tiny_models.tiny_hf_tokenizer(), 2, 24, seed=0,
                            start="chat", progress=False)  # fmt: skip
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "tokenizer, refusal",
    [
        (tiny_models.tiny_hf_tokenizer, "needs a tokenizer with a chat template"),
        (_chat_tokenizer, "leaves no token to sample after the 88-token start"),  # rows of 32 tokens
    ],
    ids=["no template", "rows too short"],
)
def test_compress_refuses_a_chat_start_it_cannot_sample_before_the_compression(tokenizer, refusal):
    """`FlattenConfig(heal=...)` checks the healing's inputs first: the dense model is left as it was."""
    heal = {**SMALL, "heldout_rows": 2, "max_tokens": 128, "mode": "full", "dataset": "teacher",
            "sampling_start": "chat"}  # fmt: skip
    model = tiny_models.tiny_llama_gqa()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=refusal):  # CalibrationDataError is a ValueError
        compress(model, "flattengpt", tokenizer(), num_layers_to_remove=2, heal=heal)
    assert len(model.model.layers) == 6 and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_cache_is_written_once_reused_and_replaced_when_the_key_changes(tmp_path):
    teacher = _counting(tiny_models.tiny_llama_gqa())
    options = dict(seed=0, batch_size=4, cache_dir=tmp_path, progress=False)
    first, record = sample_teacher_rows(teacher, TOKENIZER, 6, 16, **options)
    assert teacher.generate_calls == 2 and not record["cached"] and "sampled" not in record
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.json", "train.safetensors"]
    second, again = sample_teacher_rows(teacher, TOKENIZER, 6, 16, **options)
    assert teacher.generate_calls == 2 and again["cached"] and torch.equal(_ids(first), _ids(second))
    sampled = again["sampled"]  # what the first run's sampling cost, kept with the rows
    assert 0 < sampled["seconds"] <= record["seconds"] and sampled["peak_memory"] == record["peak_memory"]
    assert sampled["tokens_per_second"] == pytest.approx(record["generated_tokens"] / sampled["seconds"], rel=1e-2)
    save_file({"input_ids": _ids(first)}, str(tmp_path / "train.safetensors"))  # a cache from before the cost was kept
    _, older = sample_teacher_rows(teacher, TOKENIZER, 6, 16, **options)
    assert teacher.generate_calls == 2 and older["cached"] and "sampled" not in older
    _, record = sample_teacher_rows(teacher, TOKENIZER, 6, 16, temperature=2.0, **options)
    assert teacher.generate_calls == 4 and not record["cached"]
    assert json.loads((tmp_path / "train.json").read_text())["temperature"] == 2.0
    changed = copy.deepcopy(teacher)
    with torch.no_grad():
        changed.lm_head.weight.add_(0.01)
    _, record = sample_teacher_rows(_counting(changed), TOKENIZER, 6, 16, temperature=2.0, **options)
    assert not record["cached"] and changed.generate_calls == 2  # other weights: another key


def test_a_jobs_folder_refuses_rows_of_another_key_before_sampling_and_keeps_its_own(tmp_path):
    """In one job's folder (a resume folder: `one_job`) the rows kept there, complete or a stopped sampling's, are
    the job's: another seed is refused, naming it, and writes nothing; another batch size, which the default follows
    on a GPU, is the same job."""
    teacher = _counting(tiny_models.tiny_llama_gqa())
    counted = teacher.generate
    options = dict(batch_size=4, cache_dir=tmp_path, progress=False, one_job=True)

    def stopped(*args, **kwargs):
        if teacher.generate_calls == 1:
            raise KeyboardInterrupt  # stopped during its second batch: only a partial file is kept
        return counted(*args, **kwargs)

    teacher.generate = stopped
    with pytest.raises(KeyboardInterrupt):
        sample_teacher_rows(teacher, TOKENIZER, 6, 16, seed=0, **options)
    teacher.generate = counted
    for kept in ("a stopped sampling's rows", "complete rows"):
        files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        calls = teacher.generate_calls
        with pytest.raises(ValueError, match=r"holds the train rows another job sampled \(seed: 0 then, 1 now\)"):
            sample_teacher_rows(teacher, TOKENIZER, 6, 16, seed=1, **options)
        assert teacher.generate_calls == calls and {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files, kept
        sample_teacher_rows(teacher, TOKENIZER, 6, 16, seed=0, **{**options, "batch_size": 3})
    _, record = sample_teacher_rows(teacher, TOKENIZER, 6, 16, seed=1, **{**options, "one_job": False})
    assert not record["cached"]  # a cache of the user's own samples again under another key


def test_a_sampling_stopped_part_way_goes_on_from_its_next_batch_with_the_same_rows(tmp_path):
    """A sampling stopped after two of its three batches (a pre-empted job) keeps their rows, and the next call
    samples only the third: the rows equal those of a sampling never stopped, and the partial file is gone once the
    cache holds them. Another batch size keeps the stopped rows too and samples only the rest."""
    options = dict(seed=0, batch_size=4, progress=False)
    reference, _ = sample_teacher_rows(tiny_models.tiny_llama_gqa(), TOKENIZER, 10, 16, **options)
    teacher = _counting(tiny_models.tiny_llama_gqa())
    counted = teacher.generate

    def stopped(*args, **kwargs):
        if teacher.generate_calls == 2:
            raise KeyboardInterrupt  # the job is stopped during its third batch
        return counted(*args, **kwargs)

    teacher.generate = stopped
    with pytest.raises(KeyboardInterrupt):
        sample_teacher_rows(teacher, TOKENIZER, 10, 16, cache_dir=tmp_path, **options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.partial-rank0.safetensors"]
    teacher.generate = counted
    calls = teacher.generate_calls
    rows, record = sample_teacher_rows(teacher, TOKENIZER, 10, 16, cache_dir=tmp_path, **options)
    assert teacher.generate_calls == calls + 1 and record["rows_read_back"] == 8 and not record["cached"]
    # The rate is this attempt's: the 2 rows it sampled over its seconds (every row's tokens over them was ~5x high).
    this_attempt = record["generated_tokens"] * 2 // 10
    # The record's seconds are rounded to the millisecond, which on a fast attempt (tens of ms) moves the rate by
    # more than 1%: the rate must lie within what the rounded seconds allow (and its own rounding to 0.1).
    low, high = (this_attempt / (record["seconds"] + d) for d in (0.0005, -0.0005))
    assert low - 0.05 <= record["tokens_per_second"] <= high + 0.05
    assert torch.equal(_ids(rows), _ids(reference))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.json", "train.safetensors"]
    other = tmp_path / "other"
    other.mkdir()
    teacher.generate = stopped
    teacher.generate_calls = 0
    with pytest.raises(KeyboardInterrupt):
        sample_teacher_rows(teacher, TOKENIZER, 10, 16, cache_dir=other, **options)
    teacher.generate = counted
    rows, record = sample_teacher_rows(teacher, TOKENIZER, 10, 16, cache_dir=other, seed=0, batch_size=5,
                                       progress=False)  # fmt: skip
    assert record["rows_read_back"] == 8 and teacher.generate_calls == 2 + 1  # the last 2 rows in one batch of 5
    assert torch.equal(_ids(rows), _ids(reference))  # the third batch's index and rows, as a batch of 4 left them


@pytest.mark.parametrize(("free_now", "calls"), [(6, 1), (1, 2)])
def test_a_stopped_sampling_resumed_with_other_free_memory_keeps_its_rows(tmp_path, monkeypatch, free_now, calls):
    """Without a batch size given, the sampler's batch follows the free memory, which moves between attempts: the
    rows a stopped sampling kept are read back whatever it is now. With more memory the kept batch size goes on (the
    rows of a sampling never stopped); with less, the smaller one (the kept rows stay, the rest are sampled)."""
    from optimum_flatten.recovery import teacher_text

    monkeypatch.setattr(teacher_text, "default_batch_size", lambda model, seqlen: 4)
    reference, _ = sample_teacher_rows(tiny_models.tiny_llama_gqa(), TOKENIZER, 10, 16, seed=0, progress=False)
    teacher = _stopped_in_its_third_batch(tmp_path, seed=0, progress=False)
    monkeypatch.setattr(teacher_text, "default_batch_size", lambda model, seqlen: free_now)
    rows, record = sample_teacher_rows(teacher, TOKENIZER, 10, 16, seed=0, cache_dir=tmp_path, progress=False)
    assert record["rows_read_back"] == 8 and teacher.generate_calls == 2 + calls
    assert record["batch_size"] == min(4, free_now)
    assert torch.equal(_ids(rows)[:8], _ids(reference)[:8])
    assert torch.equal(_ids(rows), _ids(reference)) == (free_now >= 4)


def test_a_stopped_samplings_rows_kept_before_the_batch_size_left_their_identity_are_read_back(tmp_path):
    """Finished batches written when the batch size was part of their identity (and their count was not kept) are
    read back, and the sampling goes on from the next batch's seed: the rows equal those of one never stopped."""
    from safetensors.torch import load_file, save_file

    options = dict(seed=0, batch_size=4, progress=False)
    reference, _ = sample_teacher_rows(tiny_models.tiny_llama_gqa(), TOKENIZER, 10, 16, **options)
    teacher = _stopped_in_its_third_batch(tmp_path, **options)
    partial = tmp_path / "train.partial-rank0.safetensors"
    identity = json.loads(_metadata(partial)["identity"])
    old = {"identity": json.dumps({**identity, "batch_size": 4}, sort_keys=True)}  # as the earlier code wrote it
    save_file(load_file(str(partial)), str(partial), old)
    rows, record = sample_teacher_rows(teacher, TOKENIZER, 10, 16, cache_dir=tmp_path, seed=0, progress=False)
    assert record["rows_read_back"] == 8 and teacher.generate_calls == 2 + 1
    assert torch.equal(_ids(rows), _ids(reference))


def _stopped_in_its_third_batch(cache_dir, **options):
    """A counting teacher whose sampling of 10 rows into `cache_dir` was stopped in its third ``generate`` call (a
    pre-empted job), its ``generate`` working again."""
    teacher = _counting(tiny_models.tiny_llama_gqa())
    counted = teacher.generate

    def stopped(*args, **kwargs):
        if teacher.generate_calls == 2:
            raise KeyboardInterrupt
        return counted(*args, **kwargs)

    teacher.generate = stopped
    with pytest.raises(KeyboardInterrupt):
        sample_teacher_rows(teacher, TOKENIZER, 10, 16, cache_dir=cache_dir, **options)
    teacher.generate = counted
    return teacher


def _metadata(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as opened:
        return opened.metadata()


def test_the_sampling_batch_is_sized_to_the_free_memory():
    config = tiny_models.tiny_llama_gqa().config  # 6 layers, 2 KV heads of 8
    assert kv_cache_bytes(config, 32, 4) == 2 * 6 * 2 * 8 * 32 * 4
    row = 1000
    assert sampling_batch_size(row, 10, free_bytes=2 * 1120 * 7) == 7  # half the free memory, 1000 + 12·10 a row
    assert sampling_batch_size(row, 10, free_bytes=10) == 1
    assert sampling_batch_size(row, 10, free_bytes=10**15) == MAX_BATCH_SIZE


def test_the_teacher_share_takes_what_the_budget_reads():
    config = RecoveryConfig(max_tokens=256, teacher_text=0.25, **SMALL)  # 4 steps of 2 rows
    plan = _teacher_rows(config, 0.25, user_rows=20, replicas=1)
    assert (plan.train, plan.user, plan.heldout) == (2, 6, 1)
    assert heldout_split(4, 0.5) == (2, 2) and heldout_split(4, 1.0) == (0, 4) and heldout_split(3, 0.1) == (2, 1)
    with pytest.raises(ValueError, match="leaves 6 training rows"):
        _teacher_rows(config, 0.25, user_rows=5, replicas=1)


def test_a_mix_trains_on_both_parts_and_scores_each_part_held_out():
    config = RecoveryConfig(mode="full", max_tokens=256, teacher_text=0.5, **SMALL)
    _, log = recover(tiny_models.tiny_llama_gqa(seed=1), TOKENIZER, tiny_models.sample_texts(), config,
                     teacher=tiny_models.tiny_llama_gqa())  # fmt: skip
    assert log["data_kind"] == "mixed" and log["rows"] == 8
    assert (log["teacher_text"]["rows"], log["teacher_text"]["user_rows"], log["teacher_text"]["share"]) == (4, 4, 0.5)
    parts = log["heldout_parts"]
    assert log["heldout_rows"] == 4 and parts["user"]["rows"] == 2 and parts["teacher"]["rows"] == 2
    for part in ("user", "teacher"):
        assert set(parts[part]["before"]) == {"objective", "lm", "kl"} and set(parts[part]["after"]) == {
            "objective", "lm", "kl"
        }  # fmt: skip
    mean = (parts["user"]["before"]["objective"] + parts["teacher"]["before"]["objective"]) / 2
    assert log["heldout_before"]["objective"] == pytest.approx(mean, rel=1e-4)  # the gate's: both parts together
    assert UNGUARDED_NOTE not in log.get("notes", ())  # a mix is guarded by its user part


def test_recover_on_the_teacher_text_alone_and_resumed_reads_the_cache(tmp_path):
    teacher = _counting(tiny_models.tiny_llama_gqa())
    config = RecoveryConfig(mode="full", max_tokens=256, checkpoint_dir=str(tmp_path / "ckpt"), **SMALL)
    _, log = recover(tiny_models.tiny_llama_gqa(seed=1), TOKENIZER, "teacher", config, teacher=teacher)
    record = log["teacher_text"]
    assert log["data_kind"] == "teacher" and log["rows"] == 8 and log["steps"] == 4 and log["heldout_rows"] == 4
    assert record["share"] == 1.0 and record["rows"] == 8 and record["heldout"]["rows"] == 4 and not record["cached"]
    assert {"seconds", "tokens_per_second", "peak_memory_bytes", "seed", "temperature"} <= set(record)
    assert "heldout_parts" not in log and log["notes"] == [UNGUARDED_NOTE]
    assert (tmp_path / "ckpt" / "teacher_text" / "train.safetensors").is_file()
    calls = teacher.generate_calls
    _, again = recover(tiny_models.tiny_llama_gqa(seed=1), TOKENIZER, "teacher", config, teacher=teacher)
    assert teacher.generate_calls == calls and again["teacher_text"]["cached"]
    assert again["teacher_text"]["heldout"]["cached"]


def test_masked_loops_leave_the_repeats_out_of_the_loss_in_training_and_held_out_rows_alike(tmp_path):
    """``teacher_text_loops="mask"``: the rows the healing trains and gates on are the sampled rows with the label of
    every repeating token at -100 (`text_repetition.mask_repeats`, checked against a naive count there), the inputs
    untouched; the cache keeps the rows as sampled; the record counts the masked labels; the loss then differs from
    training on every token (the masked positions are not scored)."""
    from optimum_flatten.recovery.rows import _sample_teacher_part, _TeacherRows
    from optimum_flatten.recovery.text_repetition import repeated_mask

    teacher = tiny_models.tiny_llama_gqa()
    with torch.no_grad():  # each token's successor a sharp function of it alone: a teacher that loops, as Qwen's does
        for layer in teacher.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        teacher.lm_head.weight.mul_(200)
    options = dict(SMALL, teacher_text_cache=str(tmp_path))
    plan = _TeacherRows(share=1.0, train=6, heldout=4, user=0)
    plain, plain_held, _ = _sample_teacher_part(teacher, TOKENIZER, RecoveryConfig(**options), plan, False)
    config = RecoveryConfig(teacher_text_loops="mask", **options)
    train, heldout, record = _sample_teacher_part(teacher, TOKENIZER, config, plan, False)
    assert record["cached"]  # the same rows, read back: the mask is not part of what is sampled
    masked = 0
    for rows, reference in ((train, plain), (heldout, plain_held)):
        for row, before in zip(rows, reference, strict=True):
            assert torch.equal(row["input_ids"], before["input_ids"])
            repeats = repeated_mask(before["input_ids"].unsqueeze(0))[0]
            assert torch.equal(row["labels"], before["labels"].masked_fill(repeats, -100))
            masked += int(repeats.sum())
    assert record["loops_masked"]["tokens"] == masked > 0
    trained = RecoveryConfig(mode="full", max_tokens=192, teacher_text_loops="mask", **options)
    _, log = recover(tiny_models.tiny_llama_gqa(seed=1), TOKENIZER, "teacher", trained, teacher=teacher)
    _, unmasked = recover(tiny_models.tiny_llama_gqa(seed=1), TOKENIZER, "teacher", trained.__class__(
        **{**vars(trained), "teacher_text_loops": "train"}), teacher=teacher)  # fmt: skip
    assert log["teacher_text"]["loops_masked"]["tokens"] > 0 and "loops_masked" not in unmasked["teacher_text"]
    assert log["heldout_before"] != unmasked["heldout_before"]


@pytest.mark.parametrize("teacher", [False, "none", None])
def test_teacher_text_without_a_teacher_is_refused_before_any_weight_changes(teacher):
    model = tiny_models.tiny_llama_gqa(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="sampled from the teacher"):
        recover(model, TOKENIZER, "teacher", RecoveryConfig(mode="full", max_tokens=256, **SMALL), teacher=teacher)
    with pytest.raises(ValueError, match="sampled from the teacher"):
        config = RecoveryConfig(mode="full", max_tokens=256, teacher_text=0.5, **SMALL)
        recover(model, TOKENIZER, tiny_models.sample_texts(), config, teacher=teacher)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(teacher_text=1.5), "in \\[0, 1\\]"),
        (dict(sampling_temperature=0.0), "sampling_temperature must be a positive"),
        (dict(sampling_top_p=0.0), "sampling_top_p must be in"),
        (dict(sampling_batch_size=0), "sampling_batch_size must be at least 1"),
        (dict(sampling_start="assistant"), "sampling_start is 'bos', 'chat' or 'random'"),
        (dict(teacher_text_loops="drop"), "teacher_text_loops is 'train' or 'mask'"),
    ],
)
def test_sampling_options_out_of_range_are_refused_when_the_config_is_made(options, message):
    with pytest.raises(ValueError, match=message):
        RecoveryConfig(**options)


def test_teacher_dataset_with_a_share_to_mix_is_refused():
    config = RecoveryConfig(max_tokens=256, teacher_text=0.5, **SMALL)
    with pytest.raises(ValueError, match="no text to mix"):
        recover(tiny_models.tiny_llama_gqa(seed=1), TOKENIZER, "teacher", config, teacher=tiny_models.tiny_llama_gqa())


def test_the_footprint_counts_one_sampling_batch_before_training():
    model = tiny_models.tiny_llama_gqa()
    plain = full_footprint(model, RecoveryConfig(seqlen=32))
    sampled = full_footprint(model, RecoveryConfig(seqlen=32, teacher_text=1.0, sampling_batch_size=4))
    assert plain.sampling == 0 and sampled.sampling == 4 * (kv_cache_bytes(model.config, 32, 4) + 12 * 96)
    assert sampled.total == max(sampled.state + sampled.activations, sampled.sampling)


@pytest.mark.parametrize(
    "dataset, seqlen",
    [
        (["--dataset", "teacher"], 32),
        ([], 32),
        (["--sampling-start", "chat"], 128),
        (["--sampling-start", "random"], 32),
    ],
    ids=["given", "default", "chat", "random"],
)
def test_cli_recover_on_the_teacher_text(tmp_path, capsys, dataset, seqlen):
    """`--dataset teacher`, no `--dataset` at all, the chat template's assistant turn and a drawn first word: the
    dense model writes the healing text."""
    tokenizer = tiny_models.tiny_hf_tokenizer()
    tokenizer.chat_template = CHATML  # saved with the checkpoint, read back by the command
    dense, compressed = dense_and_compressed_on_disk(tmp_path, tokenizer)
    out = tmp_path / "healed"
    code = main([
        "recover", str(compressed), "--teacher", str(dense), *dataset, "--output", str(out),
        "--seqlen", str(seqlen), "--per-device-train-batch-size", "2", "--heldout-rows", "2", "--eval-every", "1",
        "--max-tokens", str(4 * seqlen), "--mode", "full", "--sampling-batch-size", "2", "--sampling-top-k", "0",
    ])  # fmt: skip
    assert code == 0
    recovery = json.loads((out / "flatten_report.json").read_text())["recovery"]
    assert recovery["data_kind"] == "teacher" and recovery["dataset"] == "teacher"
    assert recovery["teacher_text"]["rows"] == 4 and recovery["teacher_text"]["batch_size"] == 2
    printed = capsys.readouterr().out
    assert recovery["teacher_text"]["top_k"] is None and "gate:" in printed
    assert recovery["teacher_text"]["start"] == (dataset[1] if "--sampling-start" in dataset else "bos")
    assert f"the teacher's own text began: {recovery['teacher_text']['excerpts'][0][:160]!r}" in printed
    assert f"the teacher's own text: {describe(recovery['teacher_text']['repetition'])}" in printed
    assert "unguarded: the gate scored the teacher's own rows only" in printed  # and how to guard


def test_compress_heals_on_the_teacher_text_with_heal_dataset_teacher():
    heal = {**SMALL, "heldout_rows": 2, "max_tokens": 128, "mode": "changed", "dataset": "teacher"}
    model = tiny_models.tiny_llama_gqa()
    quantizer = compress(model, "flattengpt", TOKENIZER, num_layers_to_remove=2, heal=heal)
    log = quantizer.report["recovery"]
    assert log["data_kind"] == "teacher" and log["dataset"] == "teacher" and log["teacher_text"]["rows"] == 4
    assert log["tokens_trained"] == 128


def _sample_on_rank(rank: int, init: str, out: str) -> None:
    """One rank of a 2-process gloo group: samples 5 rows (its share: 3 or 2) and saves what it ends up holding."""
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        rows, record = sample_teacher_rows(tiny_models.tiny_llama_gqa(), TOKENIZER, 5, 16, seed=0, batch_size=3,
                                           progress=False, cache_dir=f"{out}/cache")  # fmt: skip
        torch.save({"ids": _ids(rows), "processes": record["processes"]}, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_under_torch_distributed_each_rank_samples_its_share_and_all_hold_every_row(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_sample_on_rank, args=(f"file://{tmp_path}/init", str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert torch.equal(ranks[0]["ids"], ranks[1]["ids"]) and ranks[0]["ids"].shape == (5, 16)
    assert ranks[0]["processes"] == 2
    again, record = sample_teacher_rows(tiny_models.tiny_llama_gqa(), TOKENIZER, 5, 16, seed=0, batch_size=3,
                                        progress=False, cache_dir=tmp_path / "cache")  # fmt: skip
    assert record["cached"] and record["sampled"]["processes"] == 2 and torch.equal(_ids(again), ranks[0]["ids"])
    # Rank 0's share (3 rows, one batch) is the first batch one process samples with the same seed.
    alone, _ = sample_teacher_rows(tiny_models.tiny_llama_gqa(), TOKENIZER, 5, 16, seed=0, batch_size=3, progress=False)
    assert torch.equal(ranks[0]["ids"][:3], _ids(alone)[:3]) and not torch.equal(ranks[0]["ids"][3:], _ids(alone)[3:])


def test_rows_of_a_run_stopped_while_writing_are_never_read_under_another_runs_key(tmp_path, monkeypatch):
    """Run A cached its rows and key; run B (another temperature) wrote its rows and was killed before its key: A's
    key now sits beside B's rows, and a resumed A must sample again, not train on B's rows."""
    from optimum_flatten.recovery import teacher_text_cache as cache

    key_a, key_b = {"n_rows": 2, "seqlen": 4, "temperature": 1.0}, {"n_rows": 2, "seqlen": 4, "temperature": 5.0}
    rows_a, rows_b = torch.arange(8).reshape(2, 4), torch.arange(8, 16).reshape(2, 4)
    cache.write_cache(tmp_path, "rows", key_a, rows_a, {"seconds": 1.0})
    ids, sampling = cache.read_cache(tmp_path, "rows", key_a)
    assert torch.equal(ids, rows_a) and sampling == {"seconds": 1.0}

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed before the key")

    with monkeypatch.context() as patch:
        patch.setattr(cache, "write_bytes_atomically", killed)
        with pytest.raises(KeyboardInterrupt):
            cache.write_cache(tmp_path, "rows", key_b, rows_b, {"seconds": 2.0})
    assert cache.read_cache(tmp_path, "rows", key_a) is None and cache.read_cache(tmp_path, "rows", key_b) is None
