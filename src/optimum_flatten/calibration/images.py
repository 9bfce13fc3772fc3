"""Image calibration data (a vision encoder's, ViT): images drawn with the seed and batched as pixel values.

Recognised by its type (`is_image_dataset`), so that text keeps its meaning everywhere; `build_calibration_batches`
hands such data here.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from ..config import CalibrationConfig
from ..utils.errors import CalibrationDataError
from .batch import CalibrationBatch

logger = logging.getLogger(__name__)

#: Columns searched, in order, for images in a `datasets.Dataset` without a `text_column` column.
IMAGE_COLUMNS = ("pixel_values", "image", "img")


def check_data_kind(model: Any, calibrates_on: str, calibration: Any) -> None:
    """Refuses images given to a model that reads text, and text given to one that reads images (the adapter's
    `calibrates_on`), before anything is tokenised: either used to fail later with another fault's words (a reshape
    of 0 elements deep in BERT's forward; "too few tokens for nsamples x seqlen" for a ViT)."""
    from ..utils.errors import CalibrationDataError

    images = is_image_dataset(calibration.dataset, calibration.text_column)
    if images == (calibrates_on == "images"):
        return
    name = type(model).__name__
    if images:
        raise CalibrationDataError(
            f"this {name} calibrates on {calibrates_on}, and dataset= holds images (pixel values); pass texts, a "
            "text file or a datasets name."
        )
    raise CalibrationDataError(
        f"this {name} calibrates on images, and dataset= holds text; pass a (N, C, H, W) tensor of pixel values, a "
        "list of image tensors, or images with an image processor (see docs/adapters/vit.md)."
    )


def is_image_dataset(dataset: Any, text_column: str = "text") -> bool:
    """Whether `dataset` is image calibration data (see `build_image_batches`) rather than text.

    Text keeps its meaning: strings, paths, names and a `datasets.Dataset` whose `text_column` holds strings all go
    to the text path.
    """
    if isinstance(dataset, torch.Tensor):
        return True
    if isinstance(dataset, (list, tuple)):  # records (dicts) are text, as load_texts reads them
        return bool(dataset) and not any(isinstance(item, (str, dict)) for item in dataset)
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, (list, tuple)) and hasattr(dataset, "__len__") and len(dataset) > 0:
        if text_column in columns:
            return not isinstance(dataset[0][text_column], str)
        return any(c in columns for c in IMAGE_COLUMNS)
    return False


def build_image_batches(processor: Any, config: CalibrationConfig) -> list[CalibrationBatch]:
    """Draws ``nsamples`` images (with the seed) and batches their pixel values.

    Accepted `config.dataset` forms:

    * a float tensor (N, C, H, W) of pixel values, ready for the model (normalised as its processor would);
    * a list or tuple of tensors, each (C, H, W) or (n, C, H, W), of one shape;
    * a list of images of any other type (PIL images, HWC arrays), turned into pixel values by `processor` (an
      image processor passed where a text model takes its tokenizer, e.g. ``compress(model, image_processor)``);
    * a `datasets.Dataset` whose `text_column` (or else first of ``pixel_values``, ``image``, ``img``) holds
      images: tensors and nested lists are taken as pixel values, anything else goes through `processor`.

    ``seqlen`` and ``packing`` do not apply: an image's length is fixed by the model (CLS + patches).

    Raises:
        CalibrationDataError: fewer than ``nsamples`` images, images of different shapes, or images that need a
            processor when none was given.
    """
    dataset = config.dataset
    if isinstance(dataset, torch.Tensor):
        if dataset.dim() != 4 or not dataset.is_floating_point():
            raise CalibrationDataError(
                f"an image calibration tensor must be float pixel values of shape (N, C, H, W), got "
                f"{dataset.dtype} of shape {tuple(dataset.shape)}; stack the images (torch.stack) first."
            )
        items: Any = dataset
        count = dataset.shape[0]
    elif isinstance(dataset, (list, tuple)):
        items = _split_image_tensors(dataset)
        count = len(items)
    else:
        column = _image_column(dataset, config.text_column)
        items = _DatasetColumn(dataset, column)
        count = len(dataset)
    if count < config.nsamples:
        raise CalibrationDataError(
            f"the image calibration data holds {count} images, fewer than nsamples={config.nsamples}. Give more "
            "images or lower nsamples."
        )
    rng = random.Random(config.seed)
    chosen = sorted(rng.sample(range(count), config.nsamples))
    pixel_values = _to_pixel_values([items[i] for i in chosen], processor)
    batches = [
        CalibrationBatch.from_images(pixel_values[start : start + config.batch_size])
        for start in range(0, config.nsamples, config.batch_size)
    ]
    logger.info(
        "calibration: %d images of shape %s in %d batches", config.nsamples, tuple(pixel_values.shape[1:]), len(batches)
    )
    return batches


class _DatasetColumn:
    """Row access to one column of a `datasets.Dataset`, so only the drawn images are decoded."""

    def __init__(self, dataset: Any, column: str) -> None:
        self.dataset = dataset
        self.column = column

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(index)][self.column]


def _image_column(dataset: Any, text_column: str) -> str:
    columns = list(dataset.column_names)
    for column in (text_column, *IMAGE_COLUMNS):
        if column in columns:
            return column
    raise CalibrationDataError(
        f"the dataset has no image column: looked for {[text_column, *IMAGE_COLUMNS]}, found {columns}; name the "
        "image column with text_column."
    )


def _split_image_tensors(items: list | tuple) -> list[Any]:
    """One entry per image: (n, C, H, W) tensors are split, (C, H, W) tensors and other objects kept."""
    images: list[Any] = []
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim() == 4:
            images.extend(item.unbind(0))
        else:
            images.append(item)
    return images


def _to_pixel_values(images: list[Any], processor: Any) -> torch.Tensor:
    """(N, C, H, W) float pixel values.

    Tensors are pixel values as they are. Any other image goes through `processor` when one is given; without one,
    nested lists (how `datasets` returns an array column without a format) are taken as pixel values.
    """
    has_processor = processor is not None and callable(processor)
    as_is = (torch.Tensor,) if has_processor else (torch.Tensor, list)
    if all(isinstance(image, as_is) for image in images):
        tensors = [
            torch.as_tensor(image, dtype=torch.float32) if isinstance(image, list) else image for image in images
        ]
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1 or len(next(iter(shapes))) != 3 or not all(t.is_floating_point() for t in tensors):
            raise CalibrationDataError(
                f"image calibration tensors must be float (C, H, W) pixel values of one shape, got shapes "
                f"{sorted(shapes)}; resize and normalise them (e.g. with the model's image processor) first."
            )
        return torch.stack(tensors)
    if not has_processor:
        kinds = sorted({type(image).__name__ for image in images})
        raise CalibrationDataError(
            f"the calibration images are of type {kinds}, which need an image processor to become pixel values; "
            "pass one where a text model takes its tokenizer (compress(model, image_processor)), or pass tensors."
        )
    try:
        processed = processor(images=images, return_tensors="pt")
    except TypeError as error:
        raise CalibrationDataError(
            f"the processor {type(processor).__name__} could not process images ({error}); pass the model's image "
            "processor (AutoImageProcessor.from_pretrained(...))."
        ) from error
    pixel_values = processed["pixel_values"]
    return torch.as_tensor(pixel_values, dtype=torch.float32)
