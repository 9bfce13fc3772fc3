"""Saving a compressed model as an ordinary transformers checkpoint, atomically (`export.atomic` does the writing).

Writing into an existing folder (``overwrite=True``) behaves like ``save_pretrained``: the files a checkpoint
consists of are replaced and every other file in the folder is kept. Folders where that would still lose data
(the current directory, a home folder, a non-empty folder that holds no checkpoint, the folder the model was loaded
from) are refused with the reason before anything is written.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from ..utils.errors import OutputDirectoryError
from ..utils.offload import is_offloaded
from .atomic import (
    BACKUP,
    PROBE,
    STAGING,
    check_writable,
    disk_full_message,
    follow_umask,
    is_disk_full,
    leftovers,
    make_hidden_folder,
    move_into_place,
    remove_leftovers,
)
from .model_card import method_sections, render_model_card

if TYPE_CHECKING:
    from ..compression.method import CheckpointWriter

logger = logging.getLogger(__name__)

REPORT_NAME = "flatten_report.json"
CARD_NAME = "README.md"
#: Shard size when some weights are offloaded (transformers' default of 50 GB would onload them all at once).
OFFLOADED_SHARD_SIZE = "1GB"

#: What a checkpoint consists of: transformers' weights, config and tokenizer/processor files, this library's
#: report, card and heatmap, and the files methods declare (`CompressionMethod.checkpoint_files`). A save over an
#: existing checkpoint replaces the files it writes and removes the files matching these patterns that it does not
#: write (shards of another count, the vocabulary of another tokenizer), since they would describe another model;
#: every other file is kept. Remote code of other projects (``modeling_*.py``) is replaced when written again and
#: otherwise kept: it may be the user's own.
CHECKPOINT_PATTERNS = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model-*-of-*.bin",
    "pytorch_model.bin.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "source.spm",
    "target.spm",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates",
    "preprocessor_config.json",
    "processor_config.json",
    REPORT_NAME,
    CARD_NAME,
)


def is_checkpoint_file(name: str) -> bool:
    """Whether a file or folder name in a checkpoint folder is part of the checkpoint (see CHECKPOINT_PATTERNS)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in CHECKPOINT_PATTERNS + method_checkpoint_files())


def method_checkpoint_files() -> tuple[str, ...]:
    """The file patterns registered methods' writers add to a checkpoint (e.g. remote modelling code)."""
    from ..registry import get_method_class, registered_methods

    return tuple(pattern for name in registered_methods() for pattern in get_method_class(name).checkpoint_files)


def check_output_dir(output_dir: str | Path, overwrite: bool, sources: Iterable[str | Path | None] = ()) -> Path:
    """Refuses an output folder where a save would lose data; call it before expensive work so nothing is wasted.

    An absent or empty folder is always accepted (the staging folder of an interrupted save inside it counts as
    nothing: it holds none of the user's files, and the save removes it). A non-empty one is accepted only with
    `overwrite` and only when it holds a checkpoint (config.json) that is not the current directory, a home folder,
    or one of `sources` (the folders the model was loaded from): `overwrite` replaces checkpoint files in place, so
    those folders would keep a mix of the user's files and ours, or lose the original model. Writability is tried
    where the save writes (`atomic.check_writable`): inside an existing folder, which may be a writable mount point
    under a read-only parent.

    Args:
        output_dir: The folder to save to.
        overwrite: Whether replacing the checkpoint files of an existing checkpoint is allowed.
        sources: Where the model came from (a local folder, a Hub name or None; only existing folders count).

    Returns:
        `output_dir` as a Path (not resolved).

    Raises:
        OutputDirectoryError: with the reason and what to do instead.
    """
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise OutputDirectoryError(f"output path {str(path)!r} exists and is a file; choose a directory path.")
    check_writable(path)
    _refuse_inside_source(path, sources)
    if not path.is_dir() or not _holds_files(path):
        return path
    reason = _refusal(path.resolve(), sources)
    if reason:
        raise OutputDirectoryError(
            f"refusing to save into {str(path)!r}: {reason}; choose another output folder (a new or empty one)."
        )
    if not overwrite:
        raise OutputDirectoryError(
            f"output directory {str(path)!r} is not empty (it holds a checkpoint); choose another path or pass "
            "overwrite=True (--overwrite on the command line) to replace its checkpoint files (other files are kept)."
        )
    return path


def _refuse_inside_source(path: Path, sources: Iterable[str | Path | None]) -> None:
    """Refuses an output folder inside a folder the model was loaded from: the source checkpoint (or a Hub cache's
    snapshot) would gain a folder of the compressed model's files, and a run's input stays as it was."""
    resolved = path.resolve()
    for source in sources:
        folder = Path(source).expanduser() if source else None
        if folder is not None and folder.is_dir() and folder.resolve() in resolved.parents:
            raise OutputDirectoryError(
                f"refusing to save into {str(path)!r}: it is inside the folder the model was loaded from "
                f"({str(source)!r}), which stays as it was; choose an output folder outside it."
            )


def _holds_files(path: Path) -> bool:
    """Whether the existing folder `path` holds anything but staging folders of saves to it. A save to an existing
    folder stages inside it, so a killed save to a fresh mount point leaves one there; the folder is still empty.
    Nor do write probes count (`atomic.check_writable`): under torchrun another rank's may be there for a moment."""
    ours = (f".{path.name}.{STAGING}-", f".{path.name or 'output'}.{PROBE}-")  # by name: a probe may come meanwhile
    return any(not (item.name.startswith(ours) and item.is_dir()) for item in path.iterdir())


def _refusal(path: Path, sources: Iterable[str | Path | None]) -> str | None:
    """Why `path` (resolved, an existing non-empty folder) must not be written into, or None."""
    if path == Path.cwd().resolve():
        return "it is the current working directory, whose other files a checkpoint would be mixed with"
    if path in _home_folders(path):
        return "it is a home folder"
    for source in sources:
        if source and Path(source).expanduser().is_dir() and Path(source).expanduser().resolve() == path:
            return "it is the folder the model was loaded from, and saving there would replace the original model"
    if path in _bundled_folders():
        return (
            "it is a bundled model's cached checkpoint, which every later use of that model's name (demo, compress, "
            "--baseline, --teacher) would then load in place of the dense model"
        )
    if not (path / "config.json").is_file() and not _interrupted_swap(path):
        return "it is not empty and holds no checkpoint (no config.json), so its files are not ours to replace"
    return None


def _bundled_folders() -> set[Path]:
    """The folders the bundled models' converted checkpoints are cached in (`bundled.bundled_model_path`): a bundled
    model is loaded by its name, so no `sources` argument names these folders."""
    from ..bundled import BUNDLED_MODELS, cache_dir

    root = cache_dir().expanduser()
    return {(root / spec.name).resolve() for spec in BUNDLED_MODELS.values()}


def _home_folders(path: Path) -> set[Path]:
    """This user's home folder, and `path` itself when it is the home folder of the user named like it."""
    homes = set()
    try:
        homes.add(Path.home().resolve())
    except (RuntimeError, KeyError, OSError):  # no HOME and no password entry
        pass
    try:
        import pwd

        homes.add(Path(pwd.getpwuid(os.getuid()).pw_dir).resolve())
        homes.add(Path(pwd.getpwnam(path.name).pw_dir).resolve())
    except (ImportError, KeyError, AttributeError, OSError):  # no pwd (Windows), or no user of that name
        pass
    return homes


def _interrupted_swap(path: Path) -> bool:
    """A save killed while swapping files may have moved config.json out already: its backup still holds it."""
    return any((leftover / "config.json").is_file() for leftover in leftovers(path, BACKUP))


#: Where a compression records the checkpoint the model was loaded from (`FlattenQuantizer.compress` clears the
#: config's own record, so that a LoRA adapter trained on the result does not name the dense model as its base).
COMPRESSED_FROM = "_optimum_flatten_compressed_from"


def _model_sources(model: nn.Module) -> list[str]:
    """The folder(s) the model was loaded from, as transformers records them or as the compression kept it
    (`COMPRESSED_FROM`); not the folder of our own last save (`save_compressed` records that name afterwards, and
    saving there again replaces a copy, not the original)."""
    saved = getattr(model, "_optimum_flatten_saved_to", None)
    names = {
        str(getattr(getattr(model, "config", None), "_name_or_path", "") or ""),
        str(getattr(model, "name_or_path", "") or ""),
        str(getattr(model, COMPRESSED_FROM, "") or ""),
    }
    return [name for name in names if name and name != saved]


def save_compressed(
    model: nn.Module,
    output_dir: str | Path,
    tokenizer: Any = None,
    report: dict[str, Any] | None = None,
    overwrite: bool = False,
    writer: Callable[..., str] | None = None,
    compat: Literal["v4"] | None = "v4",
) -> Path:
    """Saves weights (safetensors), config, tokenizer, flatten_report.json, README.md and the heatmap.

    Everything is written into a hidden folder first, so an error or a kill never leaves a half-written
    checkpoint: a new `output_dir` is that folder (made beside it) renamed into place. An existing one (an empty
    folder, a mount point, or a checkpoint with `overwrite`, see `check_output_dir`) has the hidden folder made
    inside it, so that no rename leaves its filesystem (a Docker volume's parent is another one), and gets its
    checkpoint files replaced one rename each, keeping every other file, as `save_pretrained` does. On an error the
    replaced files are put back and the hidden folder is removed. Leftovers of an interrupted earlier save to the
    same path are removed first. Folders and files follow the umask.

    A model that a method left in a state ``save_pretrained`` cannot describe is written by the writer that method
    names (`CompressionMethod.checkpoint_writer`, asked of every registered method), with the report entries it
    gives; the format lands in the report as ``export_format``, and a remote-code checkpoint's loader as
    ``load_with``. `writer(model, directory, **save_kwargs) -> format name` replaces the weight/config writing
    (e.g. to force a format).

    ``compat="v4"`` (the default) adds to config.json and tokenizer_config.json the keys transformers 4.x reads
    (see `add_v4_compat`), so that clients pinned below 5 load the same model; None writes the files as
    transformers 5 does.
    """
    if compat not in ("v4", None):
        raise ValueError(f"compat must be 'v4' or None, got {compat!r}.")
    from .plots import plot_layer_matrix  # matplotlib: imported only when a checkpoint is written

    path = check_output_dir(output_dir, overwrite, sources=_model_sources(model)).resolve()
    existed = (path / "config.json").is_file()
    report = dict(report or {})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(path)
        staging = make_hidden_folder(path, STAGING)
    except OSError as error:
        reason = error.strerror or error
        raise OutputDirectoryError(f"cannot write the output folder {str(path)!r}: {reason}.") from error
    from ..adapters import get_adapter

    try:
        exported = get_adapter(model).export_model()
        # transformers onloads the offloaded weights one shard at a time: small shards keep the save within the
        # memory the compression needed.
        shards = {"max_shard_size": OFFLOADED_SHARD_SIZE} if is_offloaded(exported) else {}
        report.setdefault("architecture", type(exported).__name__)
        method_writer = method_checkpoint_writer(exported)
        if method_writer is not None:
            report.update(method_writer.report)
            if writer is None:
                writer = method_writer.function
        if writer is None:
            exported.save_pretrained(staging, safe_serialization=True, **shards)
        else:
            report["export_format"] = writer(exported, staging, **shards)
            if report["export_format"] == "remote_code":
                report["load_with"] = remote_code_loader(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if compat == "v4":
            add_v4_compat(staging)
        for figure in (figure for section in method_sections(report) for figure in section.figures):
            plot_layer_matrix(figure.matrix, figure.groups, staging / figure.file_name, figure.value_label)
        (staging / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        (staging / CARD_NAME).write_text(render_model_card(report), encoding="utf-8")
        follow_umask(staging)
        move_into_place(staging, path, is_checkpoint_file)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if is_disk_full(error):
            raise OutputDirectoryError(disk_full_message(path, exported_bytes(model), existed)) from error
        raise
    # From now on the saved directory is this model's base (what PEFT records in adapter_config.json).
    from .provenance import set_name_or_path

    set_name_or_path(model, str(path))
    model._optimum_flatten_saved_to = str(path)  # a later save here replaces our copy, not the model's source
    logger.info("saved compressed model to %s", path)
    return path


def exported_bytes(model: nn.Module) -> int:
    """Bytes of the tensors a checkpoint of `model` holds (tied weights once), the space a save needs at least."""
    seen: set[int] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def method_checkpoint_writer(model: nn.Module) -> CheckpointWriter | None:
    """The writer a registered method asks for `model` (`CompressionMethod.checkpoint_writer`), or None for a
    plain ``save_pretrained``. Every method is asked, since a method's changes live in the model whichever report
    is saved; this module holds no method's test. At most one may answer: two would each describe only part of it.

    Raises:
        RuntimeError: more than one method claims the model.
    """
    from ..registry import get_method_class, registered_methods

    claims = {name: get_method_class(name).checkpoint_writer(model) for name in registered_methods()}
    claims = {name: claim for name, claim in claims.items() if claim is not None}
    if len(claims) > 1:
        raise RuntimeError(f"methods {sorted(claims)} each need their own checkpoint writer for this model.")
    return next(iter(claims.values()), None)


def remote_code_loader(directory: str | Path) -> dict[str, Any] | None:
    """How to load a checkpoint written with remote code: ``{"class": <Auto class>, "trust_remote_code": True}``
    from the ``auto_map`` of its config.json; None for a checkpoint whose class in config.json says it all."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text(encoding="utf-8"))
    autos = [name for name in config.get("auto_map", {}) if name.startswith("AutoModel")]
    return {"class": autos[0], "trust_remote_code": True} if autos else None


#: tokenizer_config.json classes of transformers 5 that 4.x does not have, and the 4.x class that reads the same
#: tokenizer.json (transformers 5 maps it back to the same class on load).
V4_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


#: 4.x's key for the RoPE theta of each layer type, for the model types whose 5.x config keeps per-layer-type
#: ``rope_parameters``; the first layer type's scaling is 4.x's ``rope_scaling`` (Gemma 3 scales only its
#: full-attention layers, and 4.x's local rotary embedding is always the default one).
V4_LAYER_TYPE_THETAS = {"gemma3_text": {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}}


def _v4_rope(config: dict[str, Any], label: str) -> list[str]:
    """`add_v4_compat`'s RoPE keys for one config (the top level, or a ``text_config``), added in place."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict):
        return []
    if not any(isinstance(v, dict) for v in rope.values()):
        if "rope_theta" not in rope:
            return []
        thetas, parameters = {"rope_theta": rope}, rope
    else:
        keys = V4_LAYER_TYPE_THETAS.get(str(config.get("model_type")))
        if keys is None or set(rope) != set(keys):
            return []
        if any(rope[kind].get("rope_type", "default") != "default" for kind in list(keys)[1:]):
            return []  # 4.x scales one layer type only
        thetas, parameters = {name: rope[kind] for kind, name in keys.items()}, rope[next(iter(keys))]
    added = []
    for name, params in thetas.items():
        if "rope_theta" in params and name not in config:
            config[name] = params["rope_theta"]
            added.append(label + name)
    if parameters.get("rope_type", "default") != "default" and config.get("rope_scaling") is None:
        config["rope_scaling"] = {k: v for k, v in parameters.items() if k != "rope_theta"}
        added.append(label + "rope_scaling")
    return added


def add_v4_compat(directory: str | Path) -> list[str]:
    """Adds to a checkpoint's config.json / tokenizer_config.json the keys transformers 4.x reads; returns them.

    transformers 5 writes RoPE settings only as ``rope_parameters``. 4.x ignores that key and falls back to
    ``rope_theta = 10000`` without a warning (SmolLM2 uses 100000: its logits move by about 2), so every client
    pinned below 5 (the optimum ONNX exporter, older servers) would silently run another model. This copies
    ``rope_theta`` (and, for a scaled RoPE, ``rope_scaling``: ``rope_parameters`` without the theta, as 4.x names
    it) to the top level. transformers 5 reads them back into the same ``rope_parameters`` (its loader merges
    ``rope_scaling`` and ``rope_theta`` into it), so its reload is unchanged. Per-layer-type (nested)
    ``rope_parameters`` are copied where 4.x has a key for each layer type (`V4_LAYER_TYPE_THETAS`: Gemma 3's
    ``rope_theta`` and ``rope_scaling`` for its full-attention layers, ``rope_local_base_freq`` for its sliding ones),
    in an image-text model's ``text_config`` too; others have no 4.x equivalent and are left alone.

    A tokenizer saved by transformers 5 as the generic ``TokenizersBackend`` (unknown to 4.x, whose AutoTokenizer
    then fails) is declared as ``PreTrainedTokenizerFast``, the 4.x class for a bare tokenizer.json; transformers 5
    maps that name to ``TokenizersBackend`` again. Keys already present are never overwritten.
    """
    directory = Path(directory)
    added = []
    config_path = directory / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        added += _v4_rope(config, "config.json: ")
        if isinstance(config.get("text_config"), dict):  # an image-text model's decoder (Gemma 3)
            added += _v4_rope(config["text_config"], "config.json: text_config.")
        if added:
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tokenizer_path = directory / "tokenizer_config.json"
    if tokenizer_path.is_file():
        tokenizer_config = json.loads(tokenizer_path.read_text(encoding="utf-8"))
        known = V4_TOKENIZER_CLASSES.get(str(tokenizer_config.get("tokenizer_class")))
        if known is not None and (directory / "tokenizer.json").is_file():
            tokenizer_config["tokenizer_class"] = known
            text = json.dumps(tokenizer_config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
            tokenizer_path.write_text(text, encoding="utf-8")
            added.append(f"tokenizer_config.json: tokenizer_class {known}")
    return added
