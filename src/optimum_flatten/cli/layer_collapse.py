"""`optimum-flatten layer-collapse`'s steps around its training: what it refuses before the model loads, what it
refuses before it trains, and what it records and prints after.

The training is the long part (minutes to hours), and the collapse and the save after it used to refuse things
that were known before it: Alpaca or chat records the collapse's calibration could not read, a text too short for
the calibration sequences, a diverged training. Every such refusal now comes before the training (or, for a
divergence, before anything is written), so that what a refusal loses is at most a model load.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .sources import check_push, check_source


@dataclass
class CollapseRequest:
    """What the options ask for, checked: which MLPs, the AdamLC schedule, and the collapse's bound."""

    selection: dict[str, Any]
    schedule: Any  # LinearisationSchedule (imported late: the parser's module does not import torch)


@dataclass
class TrainingPlan:
    """What the model and its tokenizer made of the request: the rows to train on and the collapse's config, which
    calibrates on the same texts (Alpaca prompts and chat conversations as the training renders them)."""

    rows: list[dict[str, Any]]
    kind: str
    config: Any  # FlattenConfig


def check_request(args: argparse.Namespace) -> CollapseRequest:
    """Everything the options, the output folder and a local text can say, before the model loads."""
    from ..export.checkpoint import check_output_dir
    from ..options.methods.layer_collapse import LayerCollapseConfig, LinearisationSchedule
    from ..recovery.data import check_local_recovery_data
    from ..utils.launch import launched_world_size

    if launched_world_size() > 1:  # its collapse calibrates in one process: refused before either rank trains
        raise ValueError("layer-collapse trains and collapses in one process; run it without torchrun or a launcher.")
    check_source(args.model)
    check_output_dir(args.output, args.overwrite, sources=[args.model])
    check_push(args.push_to_hub, args.private)
    selection = {k: getattr(args, k) for k in ("num_mlps", "mlp_fraction") if getattr(args, k, None) is not None}
    if len(selection) != 1:
        raise ValueError("say which MLPs to collapse: --num-mlps K (the last K not collapsed yet) or --mlp-fraction F.")
    LayerCollapseConfig(**selection)  # a count or fraction out of range, in the config's own words
    if args.seqlen < 2:
        raise ValueError(f"--seqlen must be at least 2 (a row trains each token on those before it), got {args.seqlen}")
    if args.max_samples is not None and args.max_samples < 1:
        raise ValueError(f"--max-samples must be at least 1 (or left out: every row), got {args.max_samples}")
    names = {f.name for f in dataclasses.fields(LinearisationSchedule)}
    schedule = LinearisationSchedule(**{k: v for k, v in vars(args).items() if k in names})
    if args.no_progress:  # the Trainer's bars too, as `recover` does
        extra = {"disable_tqdm": True, **schedule.extra_training_args}
        schedule = dataclasses.replace(schedule, extra_training_args=extra)
    _collapse_config(args, args.dataset)  # the calibration's and the collapse's options
    if schedule.snap_learning_rate >= args.threshold:  # the collapse would refuse every MLP after the training
        raise ValueError(
            f"--snap-learning-rate ({schedule.snap_learning_rate:g}) must be below --threshold ({args.threshold:g}): "
            "Adam's step after α lands on 1 moves it by up to the rate, leaving |1 - α| at or past the threshold."
        )
    check_local_recovery_data(args.dataset, args.text_column)
    return CollapseRequest(selection, schedule)


def _collapse_config(args: argparse.Namespace, dataset: Any) -> Any:
    """The compression that collapses the trained MLPs, calibrating its error report on `dataset`."""
    from ..config import FlattenConfig

    calibration = {"dataset": dataset, "text_column": args.text_column, "nsamples": args.nsamples}
    return FlattenConfig(method="layer_collapse", threshold=args.threshold, seqlen=args.seqlen, **calibration)


def plan_training(model: Any, tokenizer: Any, args: argparse.Namespace, request: CollapseRequest) -> TrainingPlan:
    """The rows and the collapse's calibration, built (and so refused) before the training: a causal LM with the
    positions for `--seqlen`, a text that yields rows and holds the calibration's sequences."""
    from ..adapters import get_adapter
    from ..calibration.data import build_calibration_batches
    from ..recovery.data import build_training_rows, load_recovery_texts
    from ..utils.causal_lm import non_causal_description
    from ..utils.positions import check_sequence_length

    what = non_causal_description(model.config)
    if what is not None or get_adapter(model).lm_head() is None:
        raise ValueError(
            f"the layer-collapse command trains on the next-token loss, and this {type(model).__name__} is "
            f"{what or 'a model without a causal LM head'}; for an encoder, train with your own loss through the "
            "Python API (see examples/layer_collapse)."
        )
    check_sequence_length(model, args.seqlen)
    texts, kind = load_recovery_texts(args.dataset, args.text_column, tokenizer)
    rows = build_training_rows(tokenizer, texts, kind, args.seqlen, args.max_samples, request.schedule.seed)
    # The calibration reads the texts as trained on: Alpaca and chat records rendered (plain text is read alike from
    # its name, which the report then keeps).
    config = _collapse_config(args, args.dataset if kind == "text" else texts)
    build_calibration_batches(tokenizer, config.calibration)  # too few tokens for --nsamples: refused now
    return TrainingPlan(rows, kind, config)


def prepare_and_train(
    model: Any, request: CollapseRequest, plan: TrainingPlan, args: argparse.Namespace
) -> dict[str, Any]:
    """Prepares the selected MLPs, trains every prepared α to 1, and returns the training's record; a training
    that diverged is refused here, before the collapse, naming what to change."""
    from ..adapters import get_adapter
    from ..methods.layer_collapse import prepare_layer_collapse_, train_to_linear
    from ..methods.layer_collapse.prepare import prepared_mlps, single_stack
    from ..utils.loading import public_dataset_name

    adapter = get_adapter(model)
    earlier = set(prepared_mlps(adapter, single_stack(adapter, None)))
    prepared = sorted(prepare_layer_collapse_(model, **request.selection))
    log = train_to_linear(model, plan.rows, request.schedule)
    schedule = request.schedule
    log.update(
        {
            "selection": request.selection,
            "prepared": prepared,
            # A checkpoint saved mid-training carries α on MLPs of its own; they train and collapse with these.
            "prepared_earlier": sorted(earlier - set(prepared)),
            "dataset": public_dataset_name(args.dataset),
            "text_kind": plan.kind,
            "rows_read": (schedule.pull_steps + schedule.snap_steps) * schedule.batch_size,
        }
    )
    phases = [log[p] for p in ("pull", "snap") if p in log]
    if not all(math.isfinite(a) for p in phases for a in p["alpha_after"] + [p["train_loss"]]):
        raise ValueError(
            "the training diverged (a loss or an alpha is not finite); nothing was saved. Lower --learning-rate, or "
            "train in float32."
        )
    return log


def summary_rows(log: dict[str, Any], report: dict[str, Any], seqlen: int) -> list[tuple[str, Any]]:
    """The printed table: what was prepared and trained, what collapsed, and what was saved."""
    from ..export.model_card import describe_parameters  # the saved checkpoint's count, as the card says it

    earlier = log["prepared_earlier"]
    prepared = f"{log['prepared']}, and {earlier} prepared by an earlier run" if earlier else log["prepared"]
    trained = (
        f"{log['rows_read']} row reads of {seqlen} tokens from {log['rows']} rows; alpha after: "
        f"{log['snap']['alpha_after']}"
    )
    collapsed = report["layer_collapse"]["collapsed"]
    return [
        ("MLPs prepared", prepared),
        ("training", trained),
        ("collapsed (layer, relative error)", [(r["layer"], f"{r['relative_error']:.2e}") for r in collapsed]),
        ("parameters", describe_parameters(report)),
        ("format", report["export_format"]),
    ]
