"""The published results pages are what `benchmarks/render.py` makes of the committed JSON, and the product table
follows its stated rule (sorted by the geometric mean of both ratios, the best training-free row recommended)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def render() -> ModuleType:
    """benchmarks/render.py, imported when a test of it runs (the repository root is on pytest's path)."""
    from benchmarks import render

    return render


def test_pages_match_their_json(render):
    """A number edited by hand in a page, or a JSON changed without re-rendering, fails here."""
    rendered = render.tables()
    for page, template in render.PAGES.items():
        expected = re.sub(
            r"<!-- table:([^ ]+) -->", lambda m: rendered[m.group(1)], (BENCHMARKS / template).read_text()
        )
        assert (BENCHMARKS / page).read_text() == expected, f"run python -m benchmarks.render --write ({page})"
    readme = (BENCHMARKS.parent / "README.md").read_text()
    quoted = re.findall(r"<!-- results:([^ ]+) -->\n(.*?)\n<!-- /results -->", readme, flags=re.S)
    assert quoted, "README.md quotes no results table"
    for name, table in quoted:
        assert table == rendered[name]


def test_product_page_opens_with_the_summary(render):
    lines = (BENCHMARKS / "RESULTS.md").read_text().splitlines()
    first_table = next(i for i, line in enumerate(lines) if line.startswith("| method"))
    assert first_table < 40
    for name, table in render.tables().items():
        if name.startswith("product:"):
            assert len(table.splitlines()) - 2 <= 15, name


def _quality(tmp_path: Path, rows: dict[str, tuple[float, float, float]]) -> Path:
    results = [{"variant": "dense", "perplexity": 10.0, "perplexity_kjv": 10.0, "layers": 4}]
    for variant, (sotu, kjv, passes) in rows.items():
        results.append(
            {
                "variant": variant,
                "perplexity": 10.0 * sotu,
                "perplexity_kjv": 10.0 * kjv,
                "cost_stack_passes": passes,
                "compress_seconds": 1.0,
                "peak_rss_mb": 1.0,
            }
        )
    path = tmp_path / "quality_x.json"
    path.write_text(json.dumps({"results": results}))
    return path


def test_product_table_sorts_by_both_texts_and_recommends_the_cheaper_of_equals(render, tmp_path):
    # shortgpt wins in domain but loses out of domain; replaceme_lstsq_down and auto tie, auto costs more.
    path = _quality(
        tmp_path,
        {
            "shortgpt": (1.1, 3.0, 1.0),
            "auto_down_todays_flattengpt": (1.3, 1.5, 14.0),
            "replaceme_lstsq_down": (1.3, 1.5, 2.0),
            "ablation_not_on_the_page": (1.0, 1.0, 1.0),
        },
    )
    healed = tmp_path / "recovery_x_flattengpt_full_kd_1024.json"
    block = {"ppl_ratio": 1.0, "kl": 0.0, "top1_agreement": 1.0}
    healed.write_text(
        json.dumps(
            {
                "method": "flattengpt",
                "mode": "full",
                "loss": "distillation",
                "max_tokens": 1024,
                "healed": {"sotu_from_2000": block, "bible_kjv": block},
                "recovery": {"tokens_trained": 1024},
                "compress_seconds": 1.0,
                "heal_seconds": 2.0,
                "peak_rss_mb": 3.0,
            }
        )
    )
    lines = render.product_table(path, [healed]).splitlines()[2:]
    labels = [line.split(" | ")[0] for line in lines]
    assert "healed" in labels[0]  # the best row overall is trained, so it is not the recommendation
    assert labels[1].startswith("| **`replaceme`") and "(recommended)" in labels[1]
    assert "`auto`" in labels[2] and "`shortgpt`" in labels[3]
    assert not any("ablation" in label for label in labels)


def test_product_table_leaves_out_a_healed_row_measured_on_other_tokens(render, tmp_path):
    """A ratio over 32K evaluation tokens is not comparable with the table's rows over 16K: the row goes to the
    notebook only."""
    path = _quality(tmp_path, {"replaceme_lstsq_down": (1.3, 1.5, 2.0)})
    data = json.loads(path.read_text())
    data["protocol"] = {"evaluation": "SOTU from 2000 on, 16352 scored tokens, 32 windows of 512"}
    path.write_text(json.dumps(data))
    rows = []
    for scored in (16352, 32704):
        block = {"ppl_ratio": 1.0, "kl": 0.0, "top1_agreement": 1.0, "scored_tokens": scored}
        healed = tmp_path / f"recovery_x_flattengpt_full_kd_1024_{scored}.json"
        healed.write_text(
            json.dumps(
                {
                    "method": "flattengpt",
                    "mode": "full",
                    "loss": "distillation",
                    "max_tokens": 1024 if scored == 16352 else 4096,  # the larger budget would win if it counted
                    "healed": {"sotu_from_2000": block, "bible_kjv": block},
                    "recovery": {"tokens_trained": 1024 if scored == 16352 else 4096},
                    "compress_seconds": 1.0,
                    "heal_seconds": 2.0,
                    "peak_rss_mb": 3.0,
                }
            )
        )
        rows.append(healed)
    table = render.product_table(path, rows)
    assert "(1K tokens" in table and "(4K tokens" not in table
