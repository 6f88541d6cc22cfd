"""Fuzzing the image normaliser (tests/test_data_images.py has the exact cases; these are properties over
random inputs): whatever a dataset holds, `normalize_image` returns an RGB image of the requested geometry or
raises `ImageError` with a known reason code, never another exception.

Inputs: every PIL mode with random pixel bytes (NaN/Inf included for float images) and random sizes; the
same pictures encoded as PNG/JPEG/GIF/BMP/TIFF/WebP with a random EXIF orientation, then cut at a random byte
or with a random byte changed; and plain random bytes. `EXAMPLES` per property, 4 properties.
"""

from __future__ import annotations

import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vlmrl.data.images import ImageError, normalize_image

EXAMPLES = 1000
# Damaged files make PIL warn (corrupt EXIF, odd TIFF tags) and random float pixels hold signalling NaNs:
# expected noise here, the properties are what is checked.
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.slow]  # ~6 s in all: hypothesis, hundreds of images
FUZZ = settings(max_examples=EXAMPLES, deadline=None)
REASONS = {"missing_image", "too_large", "too_small", "corrupt_image", "truncated_image"}
# "La" (premultiplied grey + alpha) was found by this fuzzer: PIL cannot convert it to RGBA directly.
MODES = ["1", "L", "P", "RGB", "RGBA", "CMYK", "YCbCr", "LAB", "HSV", "I", "F", "LA", "La", "PA", "RGBa",
         "I;16", "I;16B", "I;16L", "RGBX"]
FORMATS = ["PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP"]
POLICIES = ["squash", "fit", "max_pixels"]


@st.composite
def pictures(draw) -> Image.Image:
    mode = draw(st.sampled_from(MODES))
    size = (draw(st.integers(1, 48)), draw(st.integers(1, 48)))
    length = len(Image.new(mode, size).tobytes())
    return Image.frombytes(mode, size, draw(st.binary(min_size=length, max_size=length)))


def check(source, size: int, policy: str, original: tuple[int, int] | None = None) -> str:
    """Normalise; assert the result's geometry or the refusal's type. Returns "ok" or the reason."""
    try:
        out = normalize_image(source, size=size, policy=policy)
    except ImageError as exc:
        assert exc.reason in REASONS, exc.reason
        return exc.reason
    assert out.mode == "RGB"
    out.load()
    width, height = out.size
    if policy in ("squash", "fit"):
        assert out.size == (size, size)
    else:
        assert width >= 1 and height >= 1
        if original is not None:
            pixels = original[0] * original[1]
            budget = min(pixels, size * size)  # only ever shrinks
            # a side is never cut below 1 pixel, so a sliver (aspect beyond size^2 : 1) may keep a few more
            assert width * height <= budget or min(width, height) == 1
    return "ok"


@FUZZ
@given(img=pictures(), size=st.integers(2, 64), policy=st.sampled_from(POLICIES))
def test_any_mode_and_size_becomes_rgb_of_the_requested_geometry(img, size, policy):
    reason = check(img, size, policy, img.size)
    assert reason == "ok" or (reason == "too_small" and min(img.size) < 2)


def _encode(img: Image.Image, fmt: str, orientation: int) -> bytes | None:
    buffer = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation, 0-10: 1-8 are valid, the rest are what broken files hold
    try:
        img.save(buffer, format=fmt, exif=exif.tobytes()) if fmt in ("JPEG", "PNG", "WEBP", "TIFF") else img.save(
            buffer, format=fmt
        )
    except (OSError, ValueError, KeyError, TypeError):  # PIL cannot write this mode in this format
        return None
    return buffer.getvalue()


@FUZZ
@given(img=pictures(), fmt=st.sampled_from(FORMATS), orientation=st.integers(0, 10),
       size=st.integers(2, 64), policy=st.sampled_from(POLICIES))
def test_encoded_images_with_any_exif_orientation(img, fmt, orientation, size, policy):
    payload = _encode(img, fmt, orientation)
    if payload is not None:
        reason = check(payload, size, policy, img.size)
        assert reason == "ok" or (reason == "too_small" and min(img.size) < 2)


@FUZZ
@given(img=pictures(), fmt=st.sampled_from(FORMATS), cut=st.floats(0, 1), flip=st.integers(0, 10**6),
       size=st.integers(2, 64), policy=st.sampled_from(POLICIES))
def test_truncated_or_corrupted_files_are_refused_or_normalised(img, fmt, cut, flip, size, policy):
    payload = _encode(img, fmt, 1)
    if payload is None:
        return
    check(payload[: int(cut * len(payload))], size, policy)  # cut anywhere, header included
    damaged = bytearray(payload)
    damaged[flip % len(damaged)] ^= 0xFF
    check(bytes(damaged), size, policy)


@FUZZ
@given(payload=st.binary(max_size=512), size=st.integers(2, 64), policy=st.sampled_from(POLICIES))
def test_random_bytes_are_refused_or_normalised(payload, size, policy):
    check(payload, size, policy)


def test_premultiplied_grey_alpha_la():
    img = Image.frombytes("La", (4, 3), bytes(range(24)))
    assert normalize_image(img, size=8).mode == "RGB"
