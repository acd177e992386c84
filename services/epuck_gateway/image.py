"""Camera frames: RGB565 from the robot to Pillow images, JPEG and PNG. CPU work, no I/O."""

from __future__ import annotations

import io
from array import array

from PIL import Image

from services.epuck_gateway.protocol.wifi import IMAGE_HEIGHT, IMAGE_SIZE, IMAGE_WIDTH, ProtocolError


def rgb565_image(data: bytes, width: int = IMAGE_WIDTH, height: int = IMAGE_HEIGHT) -> Image.Image:
    """The robot's 565 words are big-endian; Pillow's "BGR;16" unpacker reads little-endian words
    with red in the high bits, so swap the bytes of each word and let Pillow's C code expand them."""
    size = width * height * 2 if (width, height) != (IMAGE_WIDTH, IMAGE_HEIGHT) else IMAGE_SIZE
    if len(data) != size or not size:
        raise ProtocolError(f"a {width}x{height} image is {size} bytes, got {len(data)}")
    words = array("H")
    words.frombytes(data)
    words.byteswap()
    return Image.frombytes("RGB", (width, height), words.tobytes(), "raw", "BGR;16")


def to_jpeg(data: bytes, quality: int, width: int = IMAGE_WIDTH, height: int = IMAGE_HEIGHT) -> bytes:
    out = io.BytesIO()
    rgb565_image(data, width, height).save(out, "JPEG", quality=quality)
    return out.getvalue()


def to_png(data: bytes, width: int = IMAGE_WIDTH, height: int = IMAGE_HEIGHT) -> bytes:
    out = io.BytesIO()
    rgb565_image(data, width, height).save(out, "PNG")
    return out.getvalue()
