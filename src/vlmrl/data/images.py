"""Turning whatever a dataset calls an image into one normalised RGB picture, or a typed refusal.

Every image, from any source, goes through `normalize_image`: EXIF orientation applied, any PIL mode to RGB
with transparency composited on white, then one of three resize policies. Images that cannot be used raise
`ImageError` with a stable reason code, which the data stage writes to `dropped.jsonl` instead of crashing.

A file is measured (stat) before it is read and read no further than `MAX_FILE_BYTES`, so a huge or sparse
file costs nothing either. The pixel check happens after `Image.open` has read only the header and before any
pixel is decoded, so a decompression bomb (a small file claiming 20000x20000 pixels) costs nothing.

`image_sha256` (exact identity of the stored PNG, so of its pixels), `dhash` (a 64-bit perceptual hash that
survives re-encoding, small brightness changes and resizing) and `pixel_difference` feed the train/holdout
contamination guard. dHash alone is too coarse for simple drawings (a small circle on white moved elsewhere
keeps the hash), so a near copy is confirmed pixel by pixel on 32x32 colour thumbnails, each pixel allowed to
match any of its 8 neighbours (resizing shifts edges by a fraction of a pixel).
"""

from __future__ import annotations

import hashlib
import io
import warnings
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

ResizePolicy = Literal["squash", "fit", "max_pixels"]

MAX_PIXELS = 100_000_000  # ~10k x 10k; MathVista's largest testmini image has 18M pixels
MAX_FILE_BYTES = 4 * MAX_PIXELS  # an uncompressed 8-bit RGBA picture at the pixel limit; real files are far smaller
MIN_SIDE = 2  # zero-size and one-pixel-wide images carry no picture
PNG_COMPRESS_LEVEL = 3  # smaller files than 1, several times faster than the default 6 on flat charts
WHITE = (255, 255, 255)
THUMB_SIDE = 32  # the pixel check's thumbnail side
PIXEL_TOLERANCE = 48  # levels (of 255) a near copy's thumbnail may differ by; re-encodes and resizes stay well under


class ImageError(ValueError):
    """An image that cannot be used. `reason` is a stable code for dropped.jsonl; `fix`, when set, is this
    case's own fix (a missing file: put it at its path), shown instead of the reason's usual one."""

    def __init__(self, reason: str, detail: str, fix: str = "") -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.fix = fix


def open_image(source: Any, *, base_dir: Path | None = None) -> Image.Image:
    """Open bytes, a path, a `{"bytes", "path"}` dict (datasets' Image storage) or a PIL image, and load it.

    Raises ImageError(`missing_image`, `too_large`, `too_small`, `corrupt_image`, `truncated_image`).
    Paths are trusted here; rows' image values go through `open_row_image`, which keeps them inside the data.
    """
    if isinstance(source, Image.Image):
        _check_size(source.size)
        return source
    if isinstance(source, dict):
        if source.get("bytes"):
            return open_image(source["bytes"])
        if source.get("path"):
            return open_image(source["path"], base_dir=base_dir)
        raise ImageError("missing_image", "image record has neither bytes nor path")
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        source = _read_limited(path)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source))
    if source is None:
        raise ImageError("missing_image", "no image in this row")
    raise ImageError("missing_image", f"cannot read an image from a {type(source).__name__}")


def open_row_image(source: Any, *, base_dir: Path | None) -> Image.Image:
    """`open_image` for a value read from a dataset row: a path must stay inside the data.

    A path (or a `{"path"}` record without bytes) resolves against `base_dir`, the data file's folder, and
    must end up inside it after symlinks are followed; hub rows (`base_dir` None) may only point into the
    Hugging Face caches. Raises ImageError(`image_url`, `outside_data_folder`) besides open_image's reasons.
    """
    if isinstance(source, dict):
        payload = source.get("bytes")
        if payload and not isinstance(payload, (bytes, bytearray, memoryview)):
            raise ImageError("corrupt_image", f"image bytes are a {type(payload).__name__}, not bytes")
        if not payload and source.get("path"):
            source = source["path"]
    if isinstance(source, (str, Path)):
        source = _inside_data(str(source), base_dir)
    return open_image(source, base_dir=base_dir)


def _inside_data(text: str, base_dir: Path | None) -> Path:
    if "://" in text or text.lower().startswith(("data:", "www.")):
        raise ImageError(
            "image_url", f"{text[:200]!r} is a URL; vlmrl does not download images (save them beside the data)"
        )
    path = Path(text)
    if base_dir is not None:
        roots = [Path(base_dir)]
        if path.is_absolute():
            raise ImageError(
                "outside_data_folder", f"{text[:200]!r} is an absolute path; use a path relative to {base_dir}"
            )
        path = Path(base_dir) / path
    else:
        roots = _hub_caches()
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL byte in the name
        raise ImageError("missing_image", f"cannot resolve {text[:200]!r} ({exc})") from None
    if not any(resolved.is_relative_to(root.resolve()) for root in roots):
        where = base_dir if base_dir is not None else "the Hugging Face cache"
        raise ImageError("outside_data_folder", f"{text[:200]!r} resolves to {resolved}, outside {where}")
    return resolved


def _hub_caches() -> list[Path]:
    """Where hub data keeps its files: images with a path and no bytes may point only there."""
    roots = []
    try:
        from huggingface_hub import constants

        roots.append(Path(constants.HF_HUB_CACHE))
    except ImportError:
        pass
    try:
        import datasets.config

        roots.append(Path(datasets.config.HF_DATASETS_CACHE))
    except ImportError:
        pass
    return roots


def normalize_image(img_or_bytes: Any, *, size: int, policy: ResizePolicy = "squash") -> Image.Image:
    """The one picture the model sees: upright, RGB on white, resized by `policy`.

    squash: exactly size x size, aspect ignored (the write-up's choice; every image costs the same tokens).
    fit: aspect kept, scaled so the longer side is `size`, padded with white to size x size.
    max_pixels: aspect kept, only shrunk, to at most size*size pixels.
    """
    img = open_image(img_or_bytes)
    img = _apply_exif(img)
    img = to_rgb(img)
    width, height = img.size
    if policy == "squash":
        if img.size != (size, size):
            img = img.resize((size, size), Image.Resampling.BICUBIC)
    elif policy == "fit":
        scale = size / max(width, height)
        inner = (max(1, round(width * scale)), max(1, round(height * scale)))
        canvas = Image.new("RGB", (size, size), WHITE)
        canvas.paste(
            img.resize(inner, Image.Resampling.BICUBIC), ((size - inner[0]) // 2, (size - inner[1]) // 2)
        )
        img = canvas
    elif policy == "max_pixels":
        if width * height > size * size:
            scale = (size * size / (width * height)) ** 0.5
            img = img.resize(
                (max(1, int(width * scale)), max(1, int(height * scale))), Image.Resampling.BICUBIC
            )
    else:
        raise ValueError(f"unknown resize policy {policy!r}; use squash, fit or max_pixels")
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode to RGB; transparent pixels become white, 16/32-bit and float data are scaled to 8 bits."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    elif mode == "La":  # premultiplied grey + alpha: PIL converts it to RGBA only by way of LA
        img = img.convert("LA").convert("RGBA")
    elif mode in ("LA", "PA", "RGBa"):
        img = img.convert("RGBA")
    elif mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        img = Image.fromarray(_to_uint8(np.asarray(img)), mode="L")
    if img.mode == "RGBA":
        canvas = Image.new("RGB", img.size, WHITE)
        canvas.paste(img, mask=img.getchannel("A"))
        return canvas
    return img.convert("RGB")


def to_png_bytes(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def image_sha256(png_bytes: bytes) -> str:
    return hashlib.sha256(png_bytes).hexdigest()


def dhash(img: Image.Image, hash_size: int = 8) -> int:
    """Difference hash: 64 bits saying whether each pixel of a 9x8 grey thumbnail is brighter than its
    right neighbour. Uniform brightness changes, re-encoding and resizing barely move it."""
    grey = img.convert("L").resize((hash_size + 1, hash_size), Image.Resampling.BOX)
    pixels = np.asarray(grey, dtype=np.int16)
    bits = (pixels[:, 1:] > pixels[:, :-1]).flatten()
    return int.from_bytes(np.packbits(bits).tobytes(), "big")


def hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()


def thumbnail(img: Image.Image) -> np.ndarray:
    """The pixel check's view of a picture: THUMB_SIDE x THUMB_SIDE RGB, box-averaged."""  # [S, S, 3]
    small = img.convert("RGB").resize((THUMB_SIDE, THUMB_SIDE), Image.Resampling.BOX)
    return np.asarray(small, dtype=np.int16)


def pixel_difference(a: np.ndarray, b: np.ndarray) -> int:
    """The largest difference (levels of 255) between two thumbnails, each pixel compared with the range of
    the other's 3x3 neighbourhood, both ways: a copy re-encoded or resized differs by little, a moved or
    refilled shape by its full contrast somewhere.

    >>> white = np.full((32, 32, 3), 255, dtype=np.int16)
    >>> dot = white.copy(); dot[10, 10] = 0
    >>> pixel_difference(white, white), pixel_difference(white, dot)
    (0, 255)
    """
    return max(_outside(a, b), _outside(b, a))


def _outside(a: np.ndarray, b: np.ndarray) -> int:
    """How far any pixel of `a` lies outside the range of `b` over its 3x3 neighbourhood."""
    height, width = b.shape[:2]
    padded = np.pad(b, ((1, 1), (1, 1), (0, 0)), mode="edge")
    shifted = np.stack([padded[dy : dy + height, dx : dx + width] for dy in range(3) for dx in range(3)])  # [9, H, W, 3]
    low, high = shifted.min(axis=0), shifted.max(axis=0)
    return int(np.maximum(a - high, low - a).max(initial=0))


def _read_limited(path: Path) -> bytes:
    """The file's bytes, refused as `too_large` by its size before reading (a 64 GiB sparse file would
    otherwise be read whole) and, should it grow meanwhile, after reading `MAX_FILE_BYTES` + 1 bytes."""
    if not path.is_file():
        raise ImageError("missing_image", f"no image file at {path}",
                         fix=f"the image file {path} is missing: put it there, or correct the row's path")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ImageError("too_large", f"{path} is {size:,} bytes, over {MAX_FILE_BYTES:,}")
    with path.open("rb") as handle:
        payload = handle.read(MAX_FILE_BYTES + 1)
    if len(payload) > MAX_FILE_BYTES:
        raise ImageError("too_large", f"{path} grew past {MAX_FILE_BYTES:,} bytes while being read")
    return payload


def _decode(payload: bytes) -> Image.Image:
    if not payload:
        raise ImageError("corrupt_image", "empty image bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit decides
            img = Image.open(io.BytesIO(payload))
    except Image.DecompressionBombError as exc:
        raise ImageError("too_large", str(exc)) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageError("corrupt_image", f"not a readable image ({exc})") from None
    _check_size(img.size)  # header only so far: refuse bombs before decoding a single pixel
    try:
        img.load()
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        reason = "truncated_image" if "truncat" in str(exc).lower() else "corrupt_image"
        raise ImageError(reason, f"cannot decode image ({exc})") from None
    return img


def _check_size(size: tuple[int, int]) -> None:
    width, height = size
    if width * height > MAX_PIXELS:
        raise ImageError("too_large", f"{width}x{height} = {width * height:,} pixels exceeds {MAX_PIXELS:,}")
    if min(width, height) < MIN_SIDE:
        raise ImageError("too_small", f"{width}x{height} pixels (need at least {MIN_SIDE} on each side)")


def _apply_exif(img: Image.Image) -> Image.Image:
    try:
        return ImageOps.exif_transpose(img)
    except Exception:  # noqa: BLE001  bad EXIF should not cost the image; keep it as stored
        return img


def _to_uint8(array: np.ndarray) -> np.ndarray:
    is_float = array.dtype.kind == "f"
    array = array.astype(np.float64)
    finite = np.isfinite(array)
    if not finite.all():
        array = np.where(finite, array, 0.0)
    low, high = float(array.min()), float(array.max())
    if is_float and low >= 0 and high <= 1.0:  # float images usually hold intensities in [0, 1]
        return (array * 255.0).round().astype(np.uint8)
    if low >= 0 and high <= 255:
        return array.astype(np.uint8)
    if low >= 0 and high <= 65535:  # 16-bit data (PNG 16-bit greyscale opens as I or I;16)
        return (array / 257.0).round().astype(np.uint8)
    span = high - low or 1.0  # anything else (float, negative, 32-bit): stretch to the full range
    return ((array - low) / span * 255.0).round().astype(np.uint8)
