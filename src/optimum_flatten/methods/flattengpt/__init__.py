"""FlattenGPT: merge adjacent layers into one double-width layer, then prune it back to the original width.

The package's shape is the one every method of several steps takes (docs/contributing/adding_a_method.md):
`method.py` (the registered `CompressionMethod`: selection, merge, pruning, corrections), `workspace.py` (its memory
model, one function per timed phase; `temporaries.py`, the single ops' byte counts it adds up), `compute.py` (its
arithmetic model), `choices.py` (the rules the run and both models share), and helpers (`similarity.py`: the
selection pass; `kv_groups.py`: KV groups kept by reconstruction; `attention_target.py`: the sequential targets;
`loss_selection.py`: pairs chosen by calibration loss). Its options are a torch-free declaration in
`optimum_flatten.options.methods.flattengpt`. Another method that builds on FlattenGPT imports the names below only.
"""

from ...options.methods.flattengpt import FlattenGPTConfig
from .flatten import fold_block_norms_
from .kv_groups import select_kv_groups_by_reconstruction
from .method import FlattenGPTMethod

__all__ = ["FlattenGPTConfig", "FlattenGPTMethod", "fold_block_norms_", "select_kv_groups_by_reconstruction"]
