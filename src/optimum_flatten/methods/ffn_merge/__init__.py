"""ffn_merge: k adjacent feed-forward sublayers share one permutation-aligned, averaged and tied MLP.

`method.py` holds the registered method (window choice and the merge), `scoring.py` how a candidate window is
scored on the calibration text and the averaged MLP it gets, `footprint.py` what the sharing saves, `tying.py` the
weight tying and its reload (`retie_ffn_`: a saved checkpoint stores the shared MLP once per layer, and tying it
again after a plain reload restores the memory saving). The options are in `optimum_flatten.options.methods.ffn_merge`.
"""

from ...options.methods.ffn_merge import FfnMergeConfig
from .method import FfnMergeMethod, WindowScorer
from .tying import read_mlp, retie_ffn_, write_mlp_

__all__ = ["FfnMergeConfig", "FfnMergeMethod", "WindowScorer", "read_mlp", "retie_ffn_", "write_mlp_"]
