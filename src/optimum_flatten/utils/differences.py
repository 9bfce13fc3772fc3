"""What differs between the options a job was started with and a rerun's, in the words a refusal prints.

One job apart: resume folders (`compression.resume`, `recovery.resume`, `recovery.teacher_text_cache`) refuse a rerun
with other options by naming each one with its two values, so that the user sees the flag they changed rather than a
hash or a digest of rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: How many differing entries a refusal names (a rerun with many changes needs only the first few to be recognised).
NAMED = 4


def describe_differences(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """``"seed: 0 then, 1 now, ..."`` for the keys whose values differ (sorted; at most `NAMED`), or ``""``."""
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return ", ".join(f"{k}: {before.get(k)!r} then, {after.get(k)!r} now" for k in changed[:NAMED])
