"""The request's own options, beside the calibration's and the method's: declared once, as one dataclass.

`FlattenConfig` takes these as keyword arguments, the command line makes one flag each (``--num-layers-to-remove``,
...) with the help text of the field's metadata, and its parsing hands back exactly these names; so adding an
option here adds it everywhere, and the three cannot drift apart. The values are checked by `FlattenConfig` (the
depth target needs the method, the corrections need the method's class).

Metadata keys: ``help`` (the flag's help), ``exclusive`` (flags in one mutually exclusive group), ``choices``
(``"methods"``: the registered method names, known without importing a method).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .corrections import COMPENSATIONS, ESTIMATORS


@dataclass
class RequestOptions:
    """What to do, at the top level of a request (`FlattenConfig`'s own options)."""

    method: str = field(default="flattengpt", metadata={"help": "compression method", "choices": "methods"})
    num_layers_to_remove: int | None = field(
        default=None,
        metadata={"help": "layers the stack loses (or --target-sparsity)", "exclusive": "target"},
    )
    target_sparsity: float | None = field(
        default=None,
        metadata={"help": "fraction of the layers removed, rounded to whole layers", "exclusive": "target"},
    )
    linear_replacement: Literal[ESTIMATORS] | None = field(  # type: ignore[valid-type]
        default=None,
        metadata={
            "help": "bridge every span of removed or merged layers with a fitted linear map folded into the down "
            "projection before it (docs/methods/replaceme.md); default: none"
        },
    )
    compensation: Literal[COMPENSATIONS] | None = field(  # type: ignore[valid-type]
        default=None,
        metadata={
            "help": "after each dropped layer, rescale the stream upstream of the cut by Prune&Comp's factor, folded "
            "into the embeddings and the output projections below it (shortgpt, sleb, uidl); default: none"
        },
    )
    stacks: list[str] | None = field(
        default=None,
        metadata={
            "help": "the block stacks to compress, by name (Marian: encoder, decoder, or both for ffn_merge with "
            "--sync-stacks true); default: the model's one stack (a model of several must name one)",
            "nargs": "+",
        },
    )
    resume_dir: str | None = field(
        default=None,
        metadata={
            "help": "keep the compression's per-layer state in this folder (plan, then one file per finished merged "
            "group), so that a run killed mid-way and started again with the same folder resumes there (flattengpt; "
            "docs/workflows.md); default: none"
        },
    )
