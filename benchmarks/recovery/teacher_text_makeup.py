"""What the dense model wrote when it healed its student: the rows of a teacher-text cache counted by script.

The teacher's own text is the teacher's distribution, whatever that is. A general English model writes English; the
bundled Qwen2.5 is the *Coder*-Instruct model, and from a bare start token it writes code and Chinese. The share of
each decides what healing on that text can teach about English prose, so the pages report it beside the rows.

Each row (``train.safetensors`` of a `--teacher-text-cache` folder, decoded with the model's tokenizer) is one of:

- **CJK**: at least 10% of its non-space characters are CJK ideographs, kana or hangul;
- **code or markup**: else at least 4% are code punctuation (``{}[]()<>;=#/\\*_|`$``; of 2,027 paragraphs of the
  first 50 speeches none reached 4%, the highest 3.8%, the median 0);
- **prose**: the rest (Latin-script text, mostly English).

The thresholds are a reading aid stated here, not a tuned classifier; a few decoded rows of each kind are written to
the JSON so that anyone can check the split by eye.

    python -m benchmarks.recovery.teacher_text_makeup --model qwen2.5-0.5b --cache DIR [--label prompted]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

CJK_SHARE = 0.10
CODE_SHARE = 0.04
CODE_CHARACTERS = frozenset("{}[]()<>;=#/\\*_|`$")


def _is_cjk(character: str) -> bool:
    point = ord(character)
    return (
        0x4E00 <= point <= 0x9FFF  # CJK unified ideographs
        or 0x3400 <= point <= 0x4DBF  # extension A
        or 0x3040 <= point <= 0x30FF  # hiragana, katakana
        or 0xAC00 <= point <= 0xD7AF  # hangul syllables
    )


def kind(text: str) -> str:
    """The row's kind by the shares above."""
    characters = [c for c in text if not c.isspace()]
    if not characters:
        return "prose"
    if sum(map(_is_cjk, characters)) >= CJK_SHARE * len(characters):
        return "CJK"
    if sum(c in CODE_CHARACTERS for c in characters) >= CODE_SHARE * len(characters):
        return "code or markup"
    return "prose"


def makeup(texts: list[str], examples: int = 2) -> dict:
    """Counts of each kind, and the first `examples` rows of each (their first 200 characters)."""
    kinds = [kind(text) for text in texts]
    shown: dict[str, list[str]] = {}
    for text, label in zip(texts, kinds, strict=True):
        if len(shown.setdefault(label, [])) < examples:
            shown[label].append(text[:200])
    return {"rows": len(texts), "counts": dict(Counter(kinds)), "examples": shown}


def main() -> None:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from optimum_flatten import bundled

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, choices=sorted(bundled.BUNDLED_MODELS))
    parser.add_argument("--cache", required=True, help="a --teacher-text-cache folder (train.safetensors, train.json)")
    parser.add_argument("--label", default="", help="a suffix for the result's file name (e.g. prompted)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    folder = Path(args.cache)
    ids = load_file(str(folder / "train.safetensors"))["input_ids"]
    key = json.loads((folder / "train.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(bundled.bundled_model_path(args.model))
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in ids.tolist()]
    result = {
        "model": args.model,
        "teacher": key.get("teacher"),
        "sampling": {k: key.get(k) for k in ("seed", "seqlen", "temperature", "top_k", "top_p", "start", "prompts")},
        "rule": f"CJK: >= {CJK_SHARE:.0%} of non-space characters; else code or markup: >= {CODE_SHARE:.0%} code "
        "punctuation; else prose",
        **makeup(texts),
    }
    suffix = f"_{args.label}" if args.label else ""
    out = Path(args.out or f"benchmarks/results/teacher_text_makeup_{args.model}{suffix}.json")
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({k: result[k] for k in ("teacher", "rows", "counts")}), f"-> {out}")


if __name__ == "__main__":
    main()
