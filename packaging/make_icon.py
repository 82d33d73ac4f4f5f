"""Draw Arbor's icon and write it in every format the bundles need: ``python packaging/make_icon.py``.

The icon is vector-drawn with Qt's QPainter at each size (no scaling of one bitmap): a rounded
green square with a white branching tree, a conversation tree's shape. Output, committed to
``packaging/icons/``:

    arbor-256.png, arbor-512.png   Linux (the .desktop entry's icon, the window icon)
    arbor.icns                     macOS (Arbor.app), PNG entries 16..1024 px incl. @2x
    arbor.ico                      Windows-style icon file (PNG entries 16..256 px)

``.icns`` and ``.ico`` are written by the small writers below (both formats are a header and a
table of PNG images), so no platform tool (``iconutil``) is needed.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "icons"
PNG_SIZES = (256, 512)
# (type code, pixel size): the PNG-carrying icns element types.
ICNS_TYPES = (
    (b"icp4", 16), (b"icp5", 32), (b"icp6", 64), (b"ic07", 128), (b"ic08", 256),
    (b"ic09", 512), (b"ic10", 1024), (b"ic11", 32), (b"ic12", 64), (b"ic13", 256),
    (b"ic14", 512),
)
ICO_SIZES = (16, 32, 48, 64, 128, 256)


def render_png(size: int) -> bytes:
    """The icon drawn at ``size`` x ``size`` pixels, as PNG bytes."""
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QPointF, QRectF, Qt
    from PySide6.QtGui import QBrush, QColor, QImage, QLinearGradient, QPainter, QPen

    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.scale(size / 100.0, size / 100.0)  # draw on a 100 x 100 canvas

    # Background: a rounded square (macOS-style margins), dark green to teal.
    gradient = QLinearGradient(QPointF(0, 0), QPointF(0, 100))
    gradient.setColorAt(0.0, QColor("#2f9e6e"))
    gradient.setColorAt(1.0, QColor("#17614a"))
    painter.setPen(Qt.PenStyle.NoPen)
    painter.setBrush(QBrush(gradient))
    painter.drawRoundedRect(QRectF(6, 6, 88, 88), 20, 20)

    # The tree: a trunk that forks twice, nodes at the tips (thicker strokes at small sizes).
    width = 6.5 if size >= 64 else 9.0
    pen = QPen(QColor("#ffffff"), width, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap,
               Qt.PenJoinStyle.RoundJoin)
    painter.setPen(pen)
    painter.setBrush(Qt.BrushStyle.NoBrush)
    root, fork, left, right = QPointF(50, 80), QPointF(50, 56), QPointF(31, 36), QPointF(69, 36)
    painter.drawLine(root, fork)
    painter.drawLine(fork, left)
    painter.drawLine(fork, right)
    painter.drawLine(QPointF(50, 56), QPointF(50, 26))
    painter.setPen(Qt.PenStyle.NoPen)
    painter.setBrush(QColor("#ffffff"))
    radius = 7.5 if size >= 64 else 9.5
    for tip in (left, right, QPointF(50, 24)):
        painter.drawEllipse(tip, radius, radius)
    painter.setBrush(QColor("#bdf5d9"))
    painter.drawEllipse(QPointF(50, 24), radius * 0.45, radius * 0.45)
    painter.end()

    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buffer, "PNG"):
        raise RuntimeError(f"could not encode the {size} px icon as PNG")
    return bytes(data.data())


def icns_bytes(pngs: dict[int, bytes]) -> bytes:
    """An .icns file: ``b"icns"`` + total length, then (type, length, PNG) per element."""
    elements = b"".join(code + struct.pack(">I", 8 + len(pngs[px])) + pngs[px] for code, px in ICNS_TYPES)
    return b"icns" + struct.pack(">I", 8 + len(elements)) + elements


def ico_bytes(pngs: dict[int, bytes]) -> bytes:
    """An .ico file: ICONDIR, one ICONDIRENTRY per size (0 means 256), then the PNG images."""
    header = struct.pack("<HHH", 0, 1, len(ICO_SIZES))
    offset = len(header) + 16 * len(ICO_SIZES)
    entries, images = b"", b""
    for px in ICO_SIZES:
        png = pngs[px]
        dim = 0 if px >= 256 else px
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(png), offset + len(images))
        images += png
    return header + entries + images


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtGui import QGuiApplication

    app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])  # noqa: F841 - QImage needs it
    sizes = set(PNG_SIZES) | {px for _, px in ICNS_TYPES} | set(ICO_SIZES)
    pngs = {px: render_png(px) for px in sorted(sizes)}
    args.out.mkdir(parents=True, exist_ok=True)
    for px in PNG_SIZES:
        (args.out / f"arbor-{px}.png").write_bytes(pngs[px])
    (args.out / "arbor.icns").write_bytes(icns_bytes(pngs))
    (args.out / "arbor.ico").write_bytes(ico_bytes(pngs))
    print(f"wrote {len(PNG_SIZES)} PNGs, arbor.icns and arbor.ico to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
