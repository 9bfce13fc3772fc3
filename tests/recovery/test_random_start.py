"""Rows that open on a word drawn from the vocabulary (`recovery.random_start`, ``sampling_start="random"``): the
draw, the greedy words after it against a naive argmax loop, the seed, the ranks, the cache key, the refusals and
the command line."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from common import compress
from optimum_flatten.options.recovery import RecoveryConfig
from optimum_flatten.recovery.random_start import GREEDY_TOKENS, OPENING_TOKENS, drawn_tokens, first_tokens
from optimum_flatten.recovery.teacher_text import sample_teacher_rows
from optimum_flatten.recovery.text_repetition import repetition_summary

TOKENIZER = tiny_models.CharTokenizer()


def _ids(rows):
    return torch.stack([row["input_ids"] for row in rows])


@torch.no_grad()
def _naive_greedy(model, ids: list[int], steps: int) -> list[int]:
    """`steps` top-1 tokens after `ids`, one full forward a token (no KV cache, no generate)."""
    ids = list(ids)
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids


def test_rows_open_on_a_drawn_word_then_the_teachers_greedy_words_then_samples():
    teacher = tiny_models.tiny_llama_gqa().eval()
    rows, record = sample_teacher_rows(teacher, TOKENIZER, 6, 20, seed=3, start="random", batch_size=4,
                                       progress=False)  # fmt: skip
    ids = _ids(rows)
    special = {TOKENIZER.bos_token_id, TOKENIZER.eos_token_id, TOKENIZER.pad_token_id}
    assert ids.shape == (6, 20) and (ids[:, 0] == TOKENIZER.bos_token_id).all()
    assert all(int(token) not in special for token in ids[:, 1])
    for row in ids:  # the opening's greedy words are the teacher's argmax after the drawn word
        assert row[: 1 + OPENING_TOKENS].tolist() == _naive_greedy(teacher, row[:2].tolist(), GREEDY_TOKENS)
    assert record["start"] == "random" and record["generated_tokens"] == 6 * (
        20 - 2
    )  # the greedy words and the samples
    assert record["repetition"] == repetition_summary(ids, skip=1 + OPENING_TOKENS)
    assert len({int(t) for t in ids[:, 1]}) > 1  # drawn, not one opening for every row
    again, _ = sample_teacher_rows(teacher, TOKENIZER, 6, 20, seed=3, start="random", batch_size=2, progress=False)
    assert torch.equal(_ids(again)[:, : 1 + OPENING_TOKENS], ids[:, : 1 + OPENING_TOKENS])  # any batch size
    other, _ = sample_teacher_rows(teacher, TOKENIZER, 6, 20, seed=4, start="random", batch_size=4, progress=False)
    held, _ = sample_teacher_rows(teacher, TOKENIZER, 6, 20, seed=3, start="random", batch_size=4, progress=False,
                                  stream="heldout")  # fmt: skip
    assert not torch.equal(_ids(other)[:, 1], ids[:, 1]) and not torch.equal(_ids(held)[:, 1], ids[:, 1])


def test_the_first_word_is_any_ordinary_token_and_never_a_special_or_added_one():
    tokenizer = tiny_models.tiny_hf_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|turn|>"]})
    marker = tokenizer.convert_tokens_to_ids("<|turn|>")
    ids = first_tokens(tokenizer, vocab_size=len(tokenizer) + 10)  # embedding rows past the tokenizer: padding
    excluded = set(tokenizer.all_special_ids) | {marker}
    assert set(ids) == set(range(len(tokenizer))) - excluded and marker in excluded
    assert first_tokens(tokenizer, vocab_size=5) == [i for i in range(5) if i not in excluded]
    # A tokenizer with no length (this suite's character tokenizer): the model's rows bound the draw.
    assert first_tokens(TOKENIZER, vocab_size=8) == [3, 4, 5, 6, 7]


def test_the_draws_do_not_depend_on_how_the_rows_are_split_between_ranks():
    candidates = list(range(100, 200))
    whole = drawn_tokens(candidates, 7, (0, 7), seed=11)
    assert drawn_tokens(candidates, 7, (0, 4), seed=11) + drawn_tokens(candidates, 7, (4, 3), seed=11) == whole
    assert drawn_tokens(candidates, 7, (0, 7), seed=12) != whole and set(whole) <= set(candidates)


def _open_on_rank(rank: int, init: str, out: str) -> None:
    """One rank of a 2-process gloo group: samples 5 random-start rows and saves what it ends up holding."""
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        rows, _ = sample_teacher_rows(tiny_models.tiny_llama_gqa(), TOKENIZER, 5, 16, seed=0, start="random",
                                      batch_size=3, progress=False)  # fmt: skip
        torch.save(_ids(rows), f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_open_the_rows_as_one_process_does(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_open_on_rank, args=(f"file://{tmp_path}/init", str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert torch.equal(ranks[0], ranks[1]) and ranks[0].shape == (5, 16)
    alone, _ = sample_teacher_rows(tiny_models.tiny_llama_gqa(), TOKENIZER, 5, 16, seed=0, start="random",
                                   batch_size=3, progress=False)  # fmt: skip
    width = 1 + OPENING_TOKENS
    assert torch.equal(ranks[0][:, :width], _ids(alone)[:, :width])


def test_a_random_start_is_another_cache_entry(tmp_path):
    teacher = tiny_models.tiny_llama_gqa()
    options = dict(seed=0, batch_size=4, progress=False, cache_dir=tmp_path)
    bos, first = sample_teacher_rows(teacher, TOKENIZER, 4, 16, **options)
    drawn, second = sample_teacher_rows(teacher, TOKENIZER, 4, 16, start="random", **options)
    assert not first["cached"] and not second["cached"] and not torch.equal(_ids(bos), _ids(drawn))
    again, third = sample_teacher_rows(teacher, TOKENIZER, 4, 16, start="random", **options)
    assert third["cached"] and torch.equal(_ids(again), _ids(drawn))


@pytest.mark.parametrize(
    "heal, refusal",
    [
        ({"prompts": "PROMPTS"}, "sampling_start='random' draws each row's first token itself and takes no prompts"),
        ({"seqlen": 6}, "seqlen=6 leaves no token to sample after the 6-token start"),
    ],
    ids=["with prompts", "rows too short"],
)
def test_compress_refuses_a_random_start_it_cannot_sample_before_the_compression(tmp_path, heal, refusal):
    """`FlattenConfig(heal=...)` checks the healing's inputs first: the dense model is left as it was."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the state of the union is strong\n")
    heal = {"seqlen": 32, "per_device_train_batch_size": 2, "heldout_rows": 2, "max_tokens": 128, "mode": "full",
            "dataset": "teacher", "sampling_start": "random",
            **{k: str(prompts) if v == "PROMPTS" else v for k, v in heal.items()}}  # fmt: skip
    model = tiny_models.tiny_llama_gqa()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=refusal) as refused:
        compress(model, "flattengpt", TOKENIZER, num_layers_to_remove=2, heal=heal)
    assert "\n" not in str(refused.value)
    assert len(model.model.layers) == 6 and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_option_is_spelled_in_the_config():
    assert RecoveryConfig(sampling_start="random").sampling_start == "random"
    with pytest.raises(ValueError, match="sampling_start is 'bos', 'chat' or 'random'"):
        RecoveryConfig(sampling_start="vocabulary")
