"""Image data specs (``--data`` for timm models): an ImageFolder directory, an ``.npz`` with ``images`` and
``labels``, a ``save_to_disk`` folder, or a ``datasets`` spec NAME[:CONFIG[:SPLIT]] whose rows have an
``image``/``img`` and a ``label``/``labels`` column (data.py lists the spec rules, data_specs.py applies them)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from ..requirements import import_optional
from .data_specs import is_saved_dataset, load_datasets_spec, load_saved_dataset, looks_like_path

IMAGE_COLUMNS = ("image", "img")
LABEL_COLUMNS = ("label", "labels")
_PROGRESS_MIN_IMAGES = 200


def _subset_indices(n: int, max_examples: int | None) -> list[int]:
    """All indices, or ``max_examples`` evenly spaced ones (``floor(i * n / max_examples)``) so that a
    class-sorted source such as an ImageFolder still gives every class."""
    if max_examples is None or n <= max_examples:
        return list(range(n))
    if max_examples < 1:
        raise DataError(f"--max-eval-examples must be at least 1, got {max_examples}")
    return [i * n // max_examples for i in range(max_examples)]


def _check_image_settings(input_size, mean, std) -> tuple[int, int, int]:
    if len(input_size) != 3 or any(int(d) < 1 for d in input_size):
        raise DataError(f"input_size must be (channels, height, width), got {tuple(input_size)}")
    channels = int(input_size[0])
    if len(mean) != channels or len(std) != channels:
        raise DataError(f"mean {tuple(mean)} and std {tuple(std)} need one value per channel ({channels})")
    if any(s == 0 for s in std):
        raise DataError(f"std {tuple(std)} contains a zero")
    return channels, int(input_size[1]), int(input_size[2])


def _normalise(pixels: torch.Tensor, mean, std) -> torch.Tensor:
    """pixels in [0, 1], shape (N, C, H, W) -> (pixels - mean) / std per channel."""
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return (pixels - mean_t) / std_t


def _pil_to_unit_array(image, channels: int, height: int, width: int) -> np.ndarray:
    """A PIL image as float32 (C, H, W) in [0, 1]: converted to L (1 channel) or RGB (3), resized (bicubic)."""
    from PIL import Image

    mode = {1: "L", 3: "RGB"}.get(channels)
    if mode is None:
        raise DataError(f"images can be read for 1 or 3 channels, but input_size asks for {channels}")
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    image = image.convert(mode)
    if image.size != (width, height):
        image = image.resize((width, height), Image.BICUBIC)
    array = np.asarray(image, dtype=np.float32) / 255.0
    return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)


def _stack_pil_images(images, labels: list[int], spec: str, input_size, mean, std):
    from ..progress import tqdm

    channels, height, width = _check_image_settings(input_size, mean, std)
    if not labels:
        raise DataError(f"data spec {spec!r} contains no images")
    pixels = np.empty((len(labels), channels, height, width), dtype=np.float32)
    for i, image in enumerate(tqdm(images, total=len(labels), desc="reading images", unit="image",
                                   disable=len(labels) < _PROGRESS_MIN_IMAGES)):
        pixels[i] = _pil_to_unit_array(image, channels, height, width)
    images_t = _normalise(torch.from_numpy(pixels), mean, std)
    return images_t, torch.tensor(labels, dtype=torch.long), {"spec": spec, "examples": len(labels)}


def _read_image_folder(spec: str, folder: Path, input_size, mean, std, max_examples):
    from PIL import Image, UnidentifiedImageError
    ImageFolder = import_optional("torchvision.datasets").ImageFolder

    class _VisibleImageFolder(ImageFolder):
        @staticmethod
        def find_classes(directory):
            classes = sorted(entry.name for entry in os.scandir(directory)
                             if entry.is_dir() and not entry.name.startswith("."))
            if not classes:
                raise FileNotFoundError(f"no class folders in {directory}")
            return classes, {name: index for index, name in enumerate(classes)}

    try:
        samples = _VisibleImageFolder(str(folder), allow_empty=True).samples
    except FileNotFoundError as error:
        raise DataError(f"{folder} is not an ImageFolder ({error}); it needs one sub-folder per class holding "
                        f"that class's images (class index = sorted folder name)") from error
    if not samples:
        raise DataError(f"the ImageFolder {folder} contains no images (.png, .jpg, ...) in its class folders")
    chosen = [samples[i] for i in _subset_indices(len(samples), max_examples)]

    def images():
        for file, _ in chosen:
            try:
                with Image.open(file) as image:
                    image.load()
                    yield image
            except (UnidentifiedImageError, OSError) as error:
                raise DataError(f"{file} in the ImageFolder {folder} is not a readable image ({error})") from error

    return _stack_pil_images(images(), [label for _, label in chosen], spec, input_size, mean, std)


def _read_npz(spec: str, path: Path, input_size, mean, std, max_examples):
    channels, height, width = _check_image_settings(input_size, mean, std)
    how = "save one with numpy.savez(path, images=..., labels=...)"
    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as error:
        raise DataError(f"{path} is not a readable .npz archive ({error}); {how}") from error
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataError(f"{path} holds a single array, not an .npz archive of 'images' and 'labels'; {how}")
    with archive:
        keys = sorted(archive.files)
        if "images" not in keys or "labels" not in keys:
            raise DataError(f"{path} needs arrays 'images' and 'labels'; it has {keys}. {how}")
        try:
            images, labels = archive["images"], archive["labels"]
        except (ValueError, OSError) as error:
            raise DataError(f"{path}: could not read its arrays ({error}); {how}") from error

    if images.ndim == 3:  # (N, H, W): one channel
        images = images[:, None]
    elif images.ndim == 4 and images.shape[-1] in (1, 3) and images.shape[1] not in (1, 3):  # (N, H, W, C)
        images = images.transpose(0, 3, 1, 2)
    elif images.ndim != 4:
        raise DataError(f"{path}: 'images' has shape {images.shape}; expected (N, H, W), (N, C, H, W) or "
                        f"(N, H, W, C)")
    if tuple(images.shape[1:]) != (channels, height, width):
        raise DataError(f"{path}: images have shape (C, H, W) = {tuple(images.shape[1:])} but the model expects "
                        f"input_size {(channels, height, width)}; resize them or save them in that shape")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise DataError(f"{path}: 'labels' has shape {labels.shape}; expected ({images.shape[0]},), one integer "
                        f"class per image")
    if images.shape[0] == 0:
        raise DataError(f"{path} contains no images")
    if not (np.issubdtype(labels.dtype, np.integer) or
            (np.issubdtype(labels.dtype, np.floating) and np.all(labels == np.round(labels)))):
        raise DataError(f"{path}: 'labels' has dtype {labels.dtype}; labels must be integer class indices")

    keep = _subset_indices(images.shape[0], max_examples)
    images, labels = images[keep], labels[keep]
    if np.issubdtype(images.dtype, np.floating):  # used as given: already preprocessed for the model
        images_t = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32))
    elif np.issubdtype(images.dtype, np.integer):  # 8-bit pixel values
        if images.min() < 0 or images.max() > 255:
            raise DataError(f"{path}: integer images must hold 8-bit pixel values 0..255, found "
                            f"{images.min()}..{images.max()}; save preprocessed images as float instead")
        unit = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)) / 255.0
        images_t = _normalise(unit, mean, std)
    else:
        raise DataError(f"{path}: 'images' has dtype {images.dtype}; use uint8 pixels or float (used as given)")
    labels_t = torch.from_numpy(np.ascontiguousarray(labels).astype(np.int64))
    return images_t, labels_t, {"spec": spec, "examples": int(images_t.shape[0])}


def _read_image_dataset(spec: str, dataset, input_size, mean, std, max_examples):
    columns = list(dataset.column_names)
    image_column = next((c for c in IMAGE_COLUMNS if c in columns), None)
    label_column = next((c for c in LABEL_COLUMNS if c in columns), None)
    if image_column is None or label_column is None:
        raise DataError(f"dataset {spec!r} needs an image column ({' or '.join(IMAGE_COLUMNS)}) and a label column "
                        f"({' or '.join(LABEL_COLUMNS)}); its columns are {columns}")
    dataset = dataset.select(_subset_indices(len(dataset), max_examples))
    labels = list(dataset[label_column])
    if labels and not all(isinstance(label, (int, np.integer)) and not isinstance(label, bool) for label in labels):
        raise DataError(f"dataset {spec!r} column {label_column!r} must hold integer class indices, "
                        f"found {type(labels[0]).__name__}")
    images = (row[image_column] for row in dataset)
    return _stack_pil_images(images, [int(label) for label in labels], spec, input_size, mean, std)


def read_images(spec: str, *, input_size: tuple[int, int, int], mean: tuple[float, ...], std: tuple[float, ...],
                max_examples: int | None = None, split: str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(images float32 (N, C, H, W), labels int64 (N,), {"spec", "examples"}) for an ImageFolder directory, an
    ``.npz`` (``images``, ``labels``), a ``save_to_disk`` folder or a datasets spec NAME[:CONFIG[:SPLIT]].

    Images read from files (ImageFolder, datasets) are converted to ``input_size[0]`` channels (L or RGB),
    resized to ``input_size[1:]`` (bicubic), scaled to [0, 1] and normalised with ``mean``/``std``.  ``.npz``
    images must already have the model's shape; uint8 ones are scaled and normalised the same way, float ones are
    used as given.  With ``max_examples`` only that many evenly spaced examples are kept (every class of a sorted
    folder is represented)."""
    spec = str(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".npz":
            raise DataError(f"{path} is not an image data set; give an ImageFolder directory (one sub-folder per "
                            f"class), an .npz with 'images' and 'labels', or a datasets spec")
        return _read_npz(spec, path, input_size, mean, std, max_examples)
    if path.is_dir():
        if is_saved_dataset(path):
            return _read_image_dataset(spec, load_saved_dataset(spec, path, split), input_size, mean, std,
                                       max_examples)
        return _read_image_folder(spec, path, input_size, mean, std, max_examples)
    if looks_like_path(spec):
        raise DataError(f"no such file or folder: {spec!r}; give an existing ImageFolder directory, an .npz file, "
                        f"or a datasets spec NAME[:CONFIG[:SPLIT]]")
    return _read_image_dataset(spec, load_datasets_spec(spec, split), input_size, mean, std, max_examples)
