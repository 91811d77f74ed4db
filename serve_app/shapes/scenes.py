"""Synthetic scenes for `builtin:shapes`, and a checker that reads them back from pixels.

A scene is one flat-coloured shape on a flat background: the training data of the embedded
model, and ground truth for the checker. The checker is plain numpy (colour distances and mask
geometry, no learned model), so a test can ask "is this a red circle?" of any image, including
the model's own output.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SIZE = 64
PALETTE = {
    "red": (220, 30, 30),
    "orange": (245, 140, 20),
    "yellow": (245, 220, 30),
    "green": (40, 170, 60),
    "cyan": (40, 200, 220),
    "blue": (40, 70, 220),
    "purple": (130, 50, 180),
    "pink": (245, 130, 190),
    "brown": (130, 80, 40),
    "white": (245, 245, 245),
    "gray": (128, 128, 128),
    "black": (15, 15, 15),
}
COLOURS = tuple(PALETTE)
SHAPES = ("circle", "square", "triangle", "star")
SIZES = {"small": 8, "large": 12}  # radius in pixels
# 3x3 grid, row-major; the words a prompt uses for each cell.
POSITIONS = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)  # fmt: skip
_CENTRES = (14, 32, 50)
# Colour-shape pairs the model never sees together in training: its test of composition.
HELD_OUT = (("purple", "circle"), ("orange", "square"), ("blue", "triangle"), ("green", "star"))
_RGB = np.array([PALETTE[c] for c in COLOURS], dtype=np.float32)


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    background: str
    position: int  # index into POSITIONS
    size: str
    dx: int = 0  # jitter of the centre, pixels
    dy: int = 0

    def prompt(self, background: bool = True, position: bool = True, size: bool = False) -> str:
        """The scene in the prompt grammar; parts left out leave the model free to choose them."""
        words = f"a {self.size + ' ' if size else ''}{self.colour} {self.shape}"
        if background:
            words += f" on a {self.background} background"
        if position:
            words += f", {POSITIONS[self.position]}"
        return words


def random_scene(rng: np.random.Generator, held_out: bool = False) -> Scene:
    """A scene drawn uniformly from the grammar; held-out colour-shape pairs only if asked."""
    while True:
        shape, colour = SHAPES[rng.integers(len(SHAPES))], COLOURS[rng.integers(len(COLOURS))]
        if ((colour, shape) in HELD_OUT) == held_out:
            break
    background = colour
    while background == colour:
        background = COLOURS[rng.integers(len(COLOURS))]
    dx, dy = rng.integers(-2, 3, size=2)
    size = ("small", "large")[rng.integers(2)]
    return Scene(shape, colour, background, int(rng.integers(9)), size, int(dx), int(dy))


def _outline(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    if shape == "triangle":
        return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "star":
        angles = np.pi / 2 + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, 1.15 * r, 0.48 * r)
        return [(cx + a * np.cos(t), cy - a * np.sin(t)) for a, t in zip(radii, angles, strict=True)]
    return None


def render(scene: Scene, colour: str | None = None) -> np.ndarray:
    """The scene as a (64, 64, 3) uint8 array, antialiased (drawn at 4x, box-filtered down).

    `colour` repaints the shape (the targets of the green adapter).
    """
    k = 4
    im = Image.new("RGB", (SIZE * k, SIZE * k), PALETTE[scene.background])
    draw = ImageDraw.Draw(im)
    row, col = divmod(scene.position, 3)
    cx, cy = (_CENTRES[col] + scene.dx) * k, (_CENTRES[row] + scene.dy) * k
    r = SIZES[scene.size] * k
    fill = PALETTE[colour or scene.colour]
    if scene.shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif scene.shape == "square":
        s = 0.9 * r
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    else:
        draw.polygon(_outline(scene.shape, cx, cy, r), fill=fill)
    return np.asarray(im.reduce(k))


# ---------------------------------------------------------------------------- the checker


@dataclass(frozen=True)
class Reading:
    """What the checker sees: the main object's colour, shape and grid cell, and the background."""

    colour: str
    shape: str
    position: int
    background: str
    colour_fraction: float  # of the object's pixels, the share nearest to `colour`
    area: int  # pixels of the object

    @property
    def position_name(self) -> str:
        return POSITIONS[self.position]


def nearest_colour(rgb: np.ndarray) -> np.ndarray:
    """Palette index nearest (RGB distance) to each pixel of an (..., 3) array."""
    d = ((rgb[..., None, :].astype(np.float32) - _RGB) ** 2).sum(-1)
    return d.argmin(-1)


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected region of `mask` (noise specks are not the object)."""
    seen = np.zeros_like(mask)
    best: list[tuple[int, int]] = []
    h, w = mask.shape
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        region, queue = [], deque([(y0, x0)])
        while queue:
            y, x = queue.popleft()
            region.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        if len(region) > len(best):
            best = region
    out = np.zeros_like(mask)
    if best:
        ys, xs = zip(*best, strict=True)
        out[list(ys), list(xs)] = True
    return out


def _hull_area(points: np.ndarray) -> float:
    """Area of the convex hull of (N, 2) points (monotone chain, then the shoelace formula)."""
    pts = sorted(set(map(tuple, points.tolist())))
    if len(pts) < 3:
        return 0.0

    def half(seq):
        chain: list[tuple[float, float]] = []
        for p in seq:
            while len(chain) >= 2:
                (ax, ay), (bx, by) = chain[-2], chain[-1]
                if (bx - ax) * (p[1] - ay) - (by - ay) * (p[0] - ax) > 0:
                    break
                chain.pop()
            chain.append(p)
        return chain

    hull = half(pts)[:-1] + half(pts[::-1])[:-1]
    xs, ys = np.array(hull, dtype=np.float64).T
    return 0.5 * abs(np.dot(xs, np.roll(ys, 1)) - np.dot(ys, np.roll(xs, 1)))


def classify_shape(mask: np.ndarray) -> str:
    """Circle, square, triangle or star, from two numbers of the mask.

    Solidity (area over convex-hull area) separates the star, the one concave shape; among the
    convex ones, the share of the bounding box they fill: square ~1, circle ~0.79, triangle ~0.5.
    """
    ys, xs = np.nonzero(mask)
    if len(ys) < 4:
        return "none"
    corners = np.concatenate([np.stack([xs + a, ys + b], 1) for a in (0, 1) for b in (0, 1)])
    solidity = len(ys) / max(_hull_area(corners), 1.0)
    fill = len(ys) / ((xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1))
    if solidity < 0.8:
        return "star"
    if fill > 0.89:
        return "square"
    return "circle" if fill > 0.65 else "triangle"


def read_image(image) -> Reading:
    """Say which colour and shape dominate `image` (PIL or HxWx3 array) and where.

    The background is the palette colour most of the border is nearest to; the object is the
    largest region of pixels far from the background's actual colour.
    """
    rgb = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)[..., :3]
    rgb = rgb.astype(np.float32)
    h, w, _ = rgb.shape
    border = np.concatenate([rgb[0], rgb[-1], rgb[:, 0], rgb[:, -1]])
    labels = nearest_colour(border)
    bg = int(np.bincount(labels, minlength=len(COLOURS)).argmax())
    bg_rgb = np.median(border[labels == bg], axis=0)
    mask = _largest_component(np.sqrt(((rgb - bg_rgb) ** 2).sum(-1)) > 60)
    ys, xs = np.nonzero(mask)
    if len(ys) == 0:
        return Reading("none", "none", 4, COLOURS[bg], 0.0, 0)
    pix_labels = nearest_colour(rgb[mask])
    counts = np.bincount(pix_labels, minlength=len(COLOURS))
    colour = int(counts.argmax())
    cy, cx = (ys.min() + ys.max() + 1) / 2, (xs.min() + xs.max() + 1) / 2
    cell = min(int(cy * 3 / h), 2) * 3 + min(int(cx * 3 / w), 2)
    return Reading(
        colour=COLOURS[colour],
        shape=classify_shape(mask),
        position=cell,
        background=COLOURS[bg],
        colour_fraction=float(counts[colour] / len(ys)),
        area=len(ys),
    )
