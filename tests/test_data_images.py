"""Image normalisation: modes, EXIF orientation, resize policies, the bomb guard, bad bytes, hashes."""

from __future__ import annotations

import hashlib
import io
import time

import numpy as np
import pytest
from PIL import Image

from tests.conftest import placeholder_image, png_bytes, png_header_only
from vlmrl.data.images import (
    MAX_PIXELS,
    ImageError,
    dhash,
    hamming,
    image_sha256,
    normalize_image,
    open_image,
    to_png_bytes,
    to_rgb,
)


def pixel(img: Image.Image, xy: tuple[int, int]) -> tuple[int, ...]:
    return tuple(img.getpixel(xy))


# --- modes -> RGB, transparency on white ---------------------------------------------------------


def test_rgba_transparent_pixels_become_white_and_opaque_keep_colour():
    img = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # red, fully transparent
    img.putpixel((1, 1), (0, 0, 255, 255))  # blue, opaque
    img.putpixel((2, 2), (0, 0, 0, 128))  # black, half transparent -> mid grey on white
    out = normalize_image(img, size=4, policy="max_pixels")
    assert out.mode == "RGB"
    assert pixel(out, (0, 0)) == (255, 255, 255)
    assert pixel(out, (1, 1)) == (0, 0, 255)
    assert all(abs(v - 127) <= 1 for v in pixel(out, (2, 2)))


def test_palette_with_transparency_composited_on_white():
    img = Image.new("P", (4, 4), 0)
    img.putpalette([0, 255, 0, 255, 0, 0] + [0] * 762)  # index 0 green, index 1 red
    img.putpixel((3, 3), 1)
    img.info["transparency"] = 0  # green is the transparent index
    out = to_rgb(Image.open(io.BytesIO(png_bytes(img))))  # through a real PNG round trip
    assert pixel(out, (0, 0)) == (255, 255, 255)
    assert pixel(out, (3, 3)) == (255, 0, 0)


def test_la_transparent_is_white():
    img = Image.new("LA", (2, 2), (0, 0))
    img.putpixel((1, 1), (30, 255))
    out = to_rgb(img)
    assert pixel(out, (0, 0)) == (255, 255, 255)
    assert pixel(out, (1, 1)) == (30, 30, 30)


@pytest.mark.parametrize(
    ("mode", "value", "expected"),
    [
        ("L", 77, 77),
        ("1", 1, 255),
        ("I;16", 65535, 255),  # 16-bit data scaled, not clipped
        ("I", 32768, 128),
        ("F", 0.5, 128),  # float intensities in [0, 1]
    ],
)
def test_grey_and_high_bit_depth_modes(mode, value, expected):
    img = Image.new(mode, (3, 3), 0)
    img.putpixel((2, 2), value)
    out = to_rgb(img)
    assert out.mode == "RGB"
    assert pixel(out, (2, 2)) == (expected,) * 3
    assert pixel(out, (0, 0)) == (0, 0, 0)


def test_cmyk_to_rgb():
    out = to_rgb(Image.new("CMYK", (2, 2), (0, 255, 255, 0)))  # pure red in CMYK
    assert pixel(out, (0, 0)) == (255, 0, 0)


def test_exif_orientation_is_applied():
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (20, 0, 40, 20))  # left red, right blue as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    buffer = io.BytesIO()
    img.save(buffer, format="PNG", exif=exif)
    out = normalize_image(buffer.getvalue(), size=10_000, policy="max_pixels")
    assert out.size == (20, 40)  # upright: portrait
    assert pixel(out, (10, 5)) == (255, 0, 0)  # stored-left (red) is now on top
    assert pixel(out, (10, 35)) == (0, 0, 255)


# --- resize policies ------------------------------------------------------------------------------


def test_squash_ignores_aspect():
    assert normalize_image(Image.new("RGB", (200, 50), "red"), size=64, policy="squash").size == (64, 64)


def test_fit_keeps_aspect_and_pads_white():
    out = normalize_image(Image.new("RGB", (200, 100), (0, 128, 0)), size=64, policy="fit")
    assert out.size == (64, 64)
    assert pixel(out, (32, 2)) == (255, 255, 255)  # padding above
    assert pixel(out, (32, 32)) == (0, 128, 0)  # content in the middle band (32 rows tall)


def test_max_pixels_only_shrinks_and_keeps_aspect():
    big = normalize_image(Image.new("RGB", (4000, 3000), "white"), size=512, policy="max_pixels")
    assert big.width * big.height <= 512 * 512
    assert abs(big.width / big.height - 4 / 3) < 0.01
    assert normalize_image(Image.new("RGB", (100, 50), "white"), size=512, policy="max_pixels").size == (
        100,
        50,
    )


# --- refusals ---------------------------------------------------------------------------------------


def test_bomb_refused_before_decoding():
    start = time.perf_counter()
    with pytest.raises(ImageError) as err:
        normalize_image(png_header_only(20_000, 20_000), size=64)
    assert err.value.reason == "too_large"
    assert "400,000,000" in err.value.detail or "pixels" in err.value.detail
    assert time.perf_counter() - start < 1.0  # nothing was decoded


def test_over_our_limit_but_under_pils_bomb_error_is_refused_by_us():
    side = int(MAX_PIXELS**0.5) + 10  # ~100.2M pixels: PIL only warns (its error starts at ~179M)
    with pytest.raises(ImageError, match="too_large"):
        open_image(png_header_only(side, side))


def test_large_but_sane_image_is_fine():
    data = png_bytes(Image.new("RGB", (4000, 3000), (10, 20, 30)))
    assert normalize_image(data, size=64).size == (64, 64)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "corrupt_image"),
        (b"definitely not an image", "corrupt_image"),
        (png_bytes(Image.new("RGB", (1, 1))), "too_small"),
        (png_header_only(0, 5), "corrupt_image"),  # PIL refuses a zero width in the header itself
    ],
)
def test_bad_bytes_raise_typed_errors(payload, reason):
    with pytest.raises(ImageError) as err:
        normalize_image(payload, size=32)
    assert err.value.reason == reason


def test_truncated_png():
    data = png_bytes(placeholder_image("truncate-me", size=(300, 200)))
    with pytest.raises(ImageError) as err:
        normalize_image(data[: len(data) // 2], size=32)
    assert err.value.reason in ("truncated_image", "corrupt_image")


def test_zero_size_pil_image():
    with pytest.raises(ImageError, match="too_small"):
        normalize_image(Image.new("RGB", (0, 7)), size=32)


def test_missing_sources():
    with pytest.raises(ImageError, match="missing_image"):
        open_image(None)
    with pytest.raises(ImageError, match="missing_image"):
        open_image({"bytes": None, "path": None})
    with pytest.raises(ImageError, match="missing_image"):
        open_image("nope/absent.png")


def test_open_from_dict_and_relative_path(tmp_path):
    img = placeholder_image("dict")
    (tmp_path / "imgs").mkdir()
    img.save(tmp_path / "imgs" / "a.png")
    assert open_image({"bytes": png_bytes(img), "path": None}).size == img.size
    assert open_image({"bytes": None, "path": "imgs/a.png"}, base_dir=tmp_path).size == img.size
    assert open_image("imgs/a.png", base_dir=tmp_path).size == img.size


# --- hashes -------------------------------------------------------------------------------------------


def test_sha256_and_png_bytes_are_deterministic():
    img = placeholder_image("sha")
    first, second = to_png_bytes(img), to_png_bytes(img.copy())
    assert first == second
    assert image_sha256(first) == hashlib.sha256(first).hexdigest()


def test_dhash_is_stable_under_brightening_and_separates_different_images():
    img = normalize_image(placeholder_image("1"), size=64)
    brighter = img.point(lambda v: min(255, v + 12))
    assert 0 <= dhash(img) < 2**64
    assert hamming(dhash(img), dhash(img)) == 0
    assert hamming(dhash(img), dhash(brighter)) <= 4
    assert hamming(dhash(img), dhash(img.resize((200, 200)))) <= 4
    others = [dhash(normalize_image(placeholder_image(str(k)), size=64)) for k in range(2, 40)]
    assert min(hamming(dhash(img), h) for h in others) > 4


def test_uniform_image_hash():
    arr = np.full((48, 64, 3), 200, dtype=np.uint8)
    assert dhash(Image.fromarray(arr)) == 0  # no pixel brighter than its neighbour
