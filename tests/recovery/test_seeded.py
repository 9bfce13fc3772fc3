"""The seeded choices a healing makes among its rows and prompts: reproducible, disjoint, in order."""

from optimum_flatten.recovery.seeded import seeded_split, seeded_subset


def test_seeded_split_is_a_reproducible_partition_in_order():
    items = [f"row {i}" for i in range(20)]
    rest, chosen = seeded_split(items, 6, seed=3)
    assert (rest, chosen) == seeded_split(items, 6, seed=3)
    assert len(chosen) == 6 and sorted(rest + chosen, key=items.index) == items
    assert rest == [x for x in items if x not in chosen] and chosen == sorted(chosen, key=items.index)
    assert seeded_split(items, 6, seed=4)[1] != chosen  # another seed, another choice


def test_seeded_subset_keeps_order_and_everything_when_asked_for_more():
    items = list(range(10))
    assert seeded_subset(items, 4, seed=1) == sorted(seeded_subset(items, 4, seed=1))
    assert len(set(seeded_subset(items, 4, seed=1))) == 4
    assert seeded_subset(items, 10, seed=1) == items and seeded_subset(items, 12, seed=1) == items
