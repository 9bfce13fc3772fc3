"""Families whose LayerNorm follows each residual add (BERT, Marian: post-LN), and what that rules out, said once.

A post-LN block normalises the sum of its input and its update, so the norm acts on the residual stream itself: its
gain and bias cannot be folded into the projections that read the stream (no `pre_norm`), and two blocks cannot run
in parallel on one input as one wider block (no `concat_heads`). Layer drops and parameter merges stay open.
"""

from __future__ import annotations


def post_ln_reasons(family: str, mlp: str, advice: str = "") -> dict[str, str]:
    """Why a post-LN `family` lacks ``pre_norm``, ``concat_heads`` and ``gated_mlp`` (its MLP is `mlp`, with no
    gate), for `ArchitectureAdapter.missing_capability_reasons`; `advice` ends the ``pre_norm`` message (what to
    use instead), where the family has one."""
    return {
        "pre_norm": f"{family} is post-LN: each LayerNorm normalises the sum of a block's input and update, so its "
        "gain and bias act on the residual stream itself and cannot be folded into the projections that read it"
        + (f"; {advice}" if advice else ""),
        "concat_heads": f"two post-LN {family} blocks cannot run in parallel on one input: each block's output is "
        "normalised as a whole, so the members' attention and MLP outputs cannot be summed into one wider block",
        "gated_mlp": f"{family}'s MLP is {mlp} without a gate projection",
    }
