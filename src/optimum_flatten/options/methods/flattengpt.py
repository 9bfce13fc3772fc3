"""FlattenGPT's options: a torch-free declaration, read by `FlattenConfig`, the command line and the method
(methods/flattengpt/method.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..hints import MethodConfig, check_scoring_batches

COVARIANCE_DTYPES = ("auto", "float32", "float64", "tf32", "bfloat16")
#: The widest statistic ``covariance_dtype="auto"`` takes on the split bfloat16 path. The split path's scatter is
#: float64, 8·w² bytes, twice the float32 path's: 3.6 GiB at LLaMA-2-7B's merged MLP (22,016 channels), 8 GiB at
#: 32,768; at LLaMA-2-70B's 57,344 it would be 24.5 GiB, where the float32 path keeps the workspace of one merged
#: pair within 40 GiB (issue 31), so a 70B model still compresses on one 80 GB GPU.
AUTO_SPLIT_MAX_WIDTH = 32768


def resolve_covariance_dtype(requested: str, activations: str, on_gpu: bool, width: int) -> str:
    """The precision a statistic of `width` channels is taken in, for ``covariance_dtype=requested``.

    ``"auto"`` is ``"bfloat16"`` (the split products on tensor cores) where the activations are bfloat16 on a CUDA
    device and the statistic is at most `AUTO_SPLIT_MAX_WIDTH` wide, else ``"float32"``. Why the activations' dtype
    decides: a bfloat16 value (8-bit significand) less a bfloat16 centre within a factor 2⁷ of it needs at most 16
    bits, so it fits the hi + lo pair of the split exactly, and the product of two bfloat16 parts is exact in
    float32; the split path's sums are then the float32 path's up to summation order (its tested bound is the
    float32 path's own plus 3·2⁻¹⁶), at tensor-core speed. Float16 (11-bit significands) and float32 activations
    would lose bits in the split, and on a CPU the split's two float32 GEMMs cost twice the float32 path's one:
    those keep ``"float32"``, so nothing measured on a CPU changes.
    """
    if requested != "auto":
        return requested
    bfloat16 = activations.removeprefix("torch.") == "bfloat16"
    return "bfloat16" if bfloat16 and on_gpu and width <= AUTO_SPLIT_MAX_WIDTH else "float32"


@dataclass
class FlattenGPTConfig(MethodConfig):
    """Options of FlattenGPT.

    Attributes:
        selection: How the merged groups are chosen. ``"similarity"`` (the paper): greedily merge the adjacent
            groups whose inputs are most alike. ``"loss"`` (not in the paper): compress every candidate group (each
            run of 2..`max_group_size` layers) once on the original model's states, as the application would, then
            greedily merge the adjacent groups whose compressed block leaves the lowest next-token NLL on the first
            `scoring_batches` calibration batches, as SLEB scores a removal; the chosen blocks are installed as
            built. ``"wide_loss"`` (not in the paper): the same greedy search scoring each candidate's wide block
            before pruning (cheaper: no candidate is pruned), which then prunes only the chosen groups
            (`flattengpt.loss_selection`). The similarity's pairs cost most out of domain on Qwen2.5-0.5B even
            unpruned (benchmarks/NOTEBOOK.md); these ask the calibration loss instead. The search costs about G²/2
            group runs and G LM heads per merge on the scored batches (G groups); ``"loss"`` adds FlattenGPT's
            per-group work for each of the L − 1 candidate pairs and holds their blocks (one layer each) until
            the plan is made.
        scoring_batches: With a loss selection, score on the first this-many calibration batches (None: all); the
            pruning always uses every batch.
        calibration_mode: ``"one_pass"`` measures every group on the original model's states (the paper);
            ``"sequential"`` measures each group on the states produced by the already-compressed layers before it.
        max_group_size: Largest number of layers merged into one (None: unlimited, as in the paper).
        ridge_ratio: λ for the leverage scores and the Nyström correction, as a multiple of the mean eigenvalue of
            C (trace / dim).
        similarity_band: How many preceding layers each layer is compared with (memory: that many float32 copies
            of the calibration states). None chooses: the full matrix when those copies fit in
            `similarity_memory_gb`, else the smallest band the selection needs (max_group_size - 1), or as many
            as fit when groups are unlimited. Must be at least max_group_size - 1.
        similarity_memory_gb: Budget for the automatic band.
        attention_correction: Not in the paper (``False``, with the paper's head selection and targets, reproduces
            it). Also refit the kept heads' o_proj columns with the same ridge (Nyström) formula used for W_down, on
            the second moment of the o_proj input, so the kept heads absorb what the pruned heads wrote to the
            residual stream. On by default because it
            measured better on SmolLM2-135M (benchmarks/NOTEBOOK.md). Costs one (2·H·head_dim)² second moment per
            group.
        head_selection: ``"importance"`` keeps the heads (KV groups) with the largest f_i (the paper);
            ``"reconstruction"`` (not in the paper; the default) keeps the KV groups whose o_proj output, after the
            ridge refit, best reproduces the attention target (below) — exhaustive when there are at most
            `MAX_EXHAUSTIVE_SUBSETS` candidate subsets, greedy backward elimination otherwise (one factorisation
            a step, `select_kv_groups_by_reconstruction`). Implies the second moment of the o_proj input; use it
            with `attention_correction=True`. The default because, with the sequential target, it measured better
            than ``"importance"`` on both evaluation texts of both SmolLM2-135M and Qwen2.5-0.5B
            (benchmarks/NOTEBOOK.md). ``"balanced"`` (not in the paper) keeps each member's best KV groups by f_i in
            equal shares (the remainder to the members with the best next group), so no member loses its attention
            altogether: an ablation of where the out-of-domain loss of the pruning comes from (benchmarks/NOTEBOOK.md).
        mlp_correction: The paper's Nyström refit of W_down on the kept channels (True). False keeps the same
            channels (ridge leverage) and only slices W_down: the ablation that tells what the refit, fitted on the
            calibration text, adds in and out of domain (benchmarks/NOTEBOOK.md).
        attention_target: What the kept heads are refitted towards (and, with ``head_selection="reconstruction"``,
            chosen by). ``"parallel"`` (the paper's wide block): every member's attention on the group's input.
            ``"sequential"`` (not in the paper): the sum of what the members' attentions wrote in the original
            stack, each on its own input (`flattengpt.attention_target`), the function the merged block replaces;
            the wide block's heads all read the group's input, so this is a regression of one on the other, with
            the ridge pulling towards the kept heads' own o_proj. The default since it measured better than the
            paper's target on both evaluation texts of both SmolLM2-135M and Qwen2.5-0.5B, with either head
            selection (benchmarks/NOTEBOOK.md); ``attention_correction=False, head_selection="importance",
            attention_target="parallel", mlp_target="parallel"`` reproduces the paper. Needs `attention_correction`
            or reconstruction (otherwise nothing is refitted). Costs one run of the group's original layers (the
            last up to its MLP norm) and a float32 copy of the calibration states per group.
        mlp_target: What the kept channels' down projection is refitted towards. ``"parallel"`` (the paper): the
            wide MLP's own output on the pruned attention's state (Nyström). ``"sequential"`` (not in the paper):
            what the whole block must still write after its pruned attention, the original group's output less the
            MLP's input residual (`flattengpt.attention_target.sequential_group_outputs`), so the MLP also absorbs
            what the merge and the attention pruning changed. The channels are chosen by leverage either way. The
            default since it measured better than the paper's refit on both evaluation texts of both SmolLM2-135M
            and Qwen2.5-0.5B, with the sequential attention target (benchmarks/NOTEBOOK.md). Costs one run of the
            group's original layers and a copy of the calibration states per group, and a float64 (g·i) × d cross
            moment; with the sequential attention target the same run serves both targets.
        attention_ridge_ratio: λ multiple for the attention refit and reconstruction; None uses `ridge_ratio`.
            1.0 measured better than 10 on SmolLM2-135M.
        covariance_dtype: Precision of the MLP statistics, the largest tensors FlattenGPT holds (the merged pair's
            MLP is 2·d_int wide: 57,344 channels at LLaMA-2-70B, where a float64 C is 24.5 GiB and its factor as
            much again). ``"float32"``: C kept as a float32 scatter about a fixed centre with the mean part exact in
            float64 (`CentredSecondMoment`), leverage scores from a float32 Cholesky factor stored as a triangle
            only, and the Nyström solve on the kept × kept block in float64 (the only block the correction
            solves): about a third of the memory, so 70B fits one 80 GB GPU. ``"float64"``: C and its full
            factor in float64, the reference the float32 path is tested against (tests/ops/test_ridge_blocked.py)
            — kept to check a result, or where memory is plentiful. ``"tf32"``: the float32 path with the
            products of both statistics (the MLP scatter and the o_proj input's moment, the largest products
            FlattenGPT computes) on CUDA's TF32 tensor cores (inputs rounded to 10 mantissa bits, sums in float32,
            bound tested on CUDA); the same as ``"float32"`` on the CPU. ``"bfloat16"``: the same two products on
            bfloat16 tensor cores with exact products: each centred activation is split into two bfloat16 parts
            (exact for a bfloat16 activation within a factor 2⁷ of the bfloat16 centre, 2⁻¹⁶ relative otherwise),
            one stacked GEMM per band of the lower block triangle gives every cross term with float32 sums over one
            chunk of tokens, and the chunks add up in a float64 scatter mirrored once: within (3·2⁻¹⁶ + γ) of the
            float32 path's own bound where TF32 allows 2·2⁻¹⁰ (`calibration.stats.add_lower_split_gram_`, tested
            against float64), at 1.6 times the flops of one bfloat16 GEMM at 22,016 channels and twice the float32
            scatter's memory (8·(2·d_int)² bytes: 3.6 GiB at LLaMA-2-7B, 24.5 GiB at 70B, where
            ``"float32"`` is the one that fits); with the sequential targets their cross moments with the targets
            too, centred, three bfloat16 cross terms in one GEMM (`calibration.stats.split_cross`) instead of
            float64 products. On the CPU the same arithmetic runs in float32 GEMMs. ``"auto"`` (the default):
            ``"bfloat16"`` for a statistic of at most 32,768 channels when the activations are bfloat16 on a CUDA
            device (exact there up to summation order: `resolve_covariance_dtype`), else ``"float32"``;
            each group's report says which it took. On an H100 at LLaMA-2-7B shape it took FlattenGPT from 10.4 to
            6.3 dense forwards (5.5 with today's code; benchmarks/RESULTS.md); every CPU measurement is unchanged.
    """

    selection: Literal["similarity", "loss", "wide_loss"] = "similarity"
    scoring_batches: int | None = 1
    calibration_mode: Literal["one_pass", "sequential"] = "one_pass"
    max_group_size: int | None = 2
    ridge_ratio: float = 10.0
    similarity_band: int | None = None
    similarity_memory_gb: float = 4.0
    attention_correction: bool = True
    head_selection: Literal["importance", "reconstruction", "balanced"] = "reconstruction"
    attention_target: Literal["parallel", "sequential"] = "sequential"
    attention_ridge_ratio: float | None = 1.0
    covariance_dtype: Literal["auto", "float32", "float64", "tf32", "bfloat16"] = "auto"
    mlp_correction: bool = True
    mlp_target: Literal["parallel", "sequential"] = "sequential"

    def __post_init__(self) -> None:
        if self.selection not in ("similarity", "loss", "wide_loss"):
            raise ValueError(f"selection must be 'similarity', 'loss' or 'wide_loss', got {self.selection!r}.")
        if self.selection == "loss" and self.calibration_mode != "one_pass":
            raise ValueError(
                "selection='loss' compresses every candidate group once, on the original model's states "
                "(calibration_mode='one_pass'); with 'sequential' each group's block would depend on the groups "
                "chosen before it. Use calibration_mode='one_pass' or selection='wide_loss'."
            )
        if self.selection == "loss" and self.max_group_size is None:
            raise ValueError(
                "selection='loss' compresses every candidate group (every run of 2..max_group_size layers) before "
                "choosing; give max_group_size (2 is the default) or use selection='wide_loss'."
            )
        check_scoring_batches(self.scoring_batches)
        if not isinstance(self.mlp_correction, bool):
            raise TypeError(f"mlp_correction must be True or False, got {self.mlp_correction!r}.")
        if self.covariance_dtype not in COVARIANCE_DTYPES:
            raise ValueError(
                "covariance_dtype must be 'auto', 'float32', 'float64', 'tf32' or 'bfloat16', got "
                f"{self.covariance_dtype!r}."
            )
        if self.head_selection not in ("importance", "reconstruction", "balanced"):
            raise ValueError(
                f"head_selection must be 'importance', 'reconstruction' or 'balanced', got {self.head_selection!r}."
            )
        if self.attention_target not in ("parallel", "sequential"):
            raise ValueError(f"attention_target must be 'parallel' or 'sequential', got {self.attention_target!r}.")
        if (
            self.attention_target == "sequential"
            and not self.attention_correction
            and self.head_selection != "reconstruction"
        ):
            raise ValueError(
                "attention_target='sequential' (the default) changes what the kept heads are refitted towards or "
                "chosen by; with attention_correction=False and head_selection other than 'reconstruction' nothing "
                "uses it. To reproduce the paper, also pass attention_target='parallel'."
            )
        if self.mlp_target not in ("parallel", "sequential"):
            raise ValueError(f"mlp_target must be 'parallel' or 'sequential', got {self.mlp_target!r}.")
        if self.mlp_target == "sequential" and not self.mlp_correction:
            raise ValueError(
                "mlp_target='sequential' (the default) changes what the kept channels' down projection is refitted "
                "towards; with mlp_correction=False nothing is refitted. Also pass mlp_target='parallel'."
            )
        ratio = self.attention_ridge_ratio
        if ratio is not None and not (ratio > 0 and math.isfinite(ratio)):
            raise ValueError(f"attention_ridge_ratio must be > 0 and finite, or None, got {ratio!r}.")
        if self.calibration_mode not in ("one_pass", "sequential"):
            raise ValueError(f"calibration_mode must be 'one_pass' or 'sequential', got {self.calibration_mode!r}.")
        if self.max_group_size is not None and (not isinstance(self.max_group_size, int) or self.max_group_size < 2):
            raise ValueError(f"max_group_size must be an integer >= 2 or None, got {self.max_group_size!r}.")
        if not (self.ridge_ratio > 0 and math.isfinite(self.ridge_ratio)):
            raise ValueError(f"ridge_ratio must be > 0 and finite, got {self.ridge_ratio!r}.")
        if not (self.similarity_memory_gb > 0 and math.isfinite(self.similarity_memory_gb)):
            raise ValueError(
                f"similarity_memory_gb must be a positive number of GB, got {self.similarity_memory_gb!r}."
            )
        if self.similarity_band is not None:
            if not isinstance(self.similarity_band, int) or self.similarity_band < 1:
                raise ValueError(f"similarity_band must be a positive integer or None, got {self.similarity_band!r}.")
            if self.max_group_size is None or self.similarity_band < self.max_group_size - 1:
                raise ValueError(
                    f"similarity_band={self.similarity_band} cannot judge groups of max_group_size="
                    f"{self.max_group_size}; use a band of at least max_group_size - 1, or None."
                )
