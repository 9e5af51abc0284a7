"""A FEMNIST-like federated image source, generated (no download): :func:`femnist_like`
renders glyph classes with per-writer style, one client per writer (FEMNIST: LEAF, Caldas et
al., 2018)."""

from __future__ import annotations

import numpy as np

from fedsim.data.sources import ClientData, check_count, split_rows

_SIDE = 28
_STROKE_POINTS = 32  # points sampled along each stroke
_MAX_STROKES = 3
_CLASS_CONCENTRATION = 0.5  # per-writer label distribution ~ Dir(0.5 * 1_C)
_SIZE_MEDIAN, _SIZE_SIGMA, _SIZE_MIN, _SIZE_MAX = 200.0, 0.5, 10, 1000  # FEMNIST: ~226/writer
_THICKNESS = (0.5, 0.7, 0.9, 1.1)  # Gaussian blur sigmas (pixels) a writer may use
_NOISE_HALF_WIDTH = 0.14  # pixel noise ~ U(-0.14, 0.14): standard deviation 0.08
_CHUNK = 16384  # samples generated per vectorised batch (bounds memory)
_GLYPH_HALF_SIZE = 9.5  # pixels from the image centre to a glyph coordinate of +-1
_INK_GAIN = 1.6  # blurred stroke centres reach 1.6 before clipping to 1


def _glyph_points(rng: np.random.Generator, num_classes: int) -> np.ndarray:
    """Stroke points of ``num_classes`` random glyphs, shape (C, S*P, 3): (x, y, ink).

    Each glyph is 1..3 quadratic Bezier strokes in [-1, 1]^2: a start point, an
    end point 1.0-2.0 away (clipped to the box) and a control point pushed
    sideways from the middle (curvature). ``ink`` is the length each point stands
    for, in pixels, so a stroke deposits one unit of ink per pixel of length;
    unused strokes have ink 0.
    """
    c, s = num_classes, _MAX_STROKES
    start = rng.uniform(-0.9, 0.9, size=(c, s, 2))
    angle = rng.uniform(0.0, 2 * np.pi, size=(c, s))
    length = rng.uniform(1.0, 2.0, size=(c, s))
    direction = np.stack([np.cos(angle), np.sin(angle)], axis=-1)
    end = np.clip(start + length[..., None] * direction, -1.0, 1.0)
    normal = np.stack([-direction[..., 1], direction[..., 0]], axis=-1)
    bend = rng.uniform(-0.7, 0.7, size=(c, s, 1)) * length[..., None]
    ctrl = np.stack([start, (start + end) / 2 + bend * normal, end], axis=2)  # (C, S, 3, 2)
    t = np.linspace(0.0, 1.0, _STROKE_POINTS)[:, None]
    basis = np.concatenate([(1 - t) ** 2, 2 * t * (1 - t), t**2], axis=1)  # (P, 3)
    pts = np.einsum("pj,csjd->cspd", basis, ctrl)  # (C, S, P, 2)
    seg = np.linalg.norm(np.diff(pts, axis=2), axis=-1).sum(axis=2)  # stroke length, glyph units
    strokes = rng.integers(1, _MAX_STROKES + 1, size=c)
    used = np.arange(s)[None, :] < strokes[:, None]
    ink = np.where(used, seg * _GLYPH_HALF_SIZE / (_STROKE_POINTS - 1), 0.0)
    ink = np.broadcast_to(ink[:, :, None, None], (*pts.shape[:3], 1))
    out = np.concatenate([pts, ink], axis=-1)
    return out.reshape(c, s * _STROKE_POINTS, 3)


def _render(points: np.ndarray, affine: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Splat transformed stroke points into (m, 28, 28) float32 images (bilinear).

    points: (m, M, 3) glyph points (x, y, ink) in [-1, 1]; affine: (m, 2, 2);
    shift: (m, 2) in pixels. Glyph coordinate 0 maps to the image centre and
    +-1 to +-9.5 pixels (about (F)EMNIST's 20x20 box). Pixel values are ink per pixel.
    """
    m = points.shape[0]
    px, py, ink = points[..., 0], points[..., 1], points[..., 2]
    centre = (_SIDE - 1) / 2.0
    half = _GLYPH_HALF_SIZE
    gx = (affine[:, 0, 0, None] * px + affine[:, 0, 1, None] * py) * half + centre + shift[:, :1]
    gy = (affine[:, 1, 0, None] * px + affine[:, 1, 1, None] * py) * half + centre + shift[:, 1:]
    bx, by = np.floor(gx), np.floor(gy)
    fx, fy = gx - bx, gy - by
    bx, by = bx.astype(np.int64), by.astype(np.int64)
    sample = np.arange(m)[:, None] * (_SIDE * _SIDE)
    idx, wts = [], []
    for dx, wx in ((0, 1 - fx), (1, fx)):
        for dy, wy in ((0, 1 - fy), (1, fy)):
            cx, cy = bx + dx, by + dy
            inside = (cx >= 0) & (cx < _SIDE) & (cy >= 0) & (cy < _SIDE) & (ink > 0)
            idx.append((sample + cy * _SIDE + cx)[inside])
            wts.append((wx * wy * ink)[inside])
    img = np.bincount(np.concatenate(idx), weights=np.concatenate(wts), minlength=m * _SIDE * _SIDE)
    return img.reshape(m, _SIDE, _SIDE).astype(np.float32)


def _writer_counts(
    rng: np.random.Generator, num_writers: int, samples_per_writer: int | None, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each writer's size (``samples_per_writer``, or FEMNIST-like log-normal sizes) and its
    samples per class, ``(W, C)``, from its own label distribution ~ Dir(0.5 * 1_C)."""
    if samples_per_writer is None:
        raw = rng.lognormal(np.log(_SIZE_MEDIAN), _SIZE_SIGMA, size=num_writers)
        sizes = np.clip(np.round(raw), _SIZE_MIN, _SIZE_MAX).astype(np.int64)
    else:
        sizes = np.full(num_writers, int(samples_per_writer), dtype=np.int64)
    counts = rng.multinomial(
        sizes, rng.dirichlet(np.full(num_classes, _CLASS_CONCENTRATION), size=num_writers)
    )
    return sizes, counts


def _writer_styles(
    rng: np.random.Generator, num_writers: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`femnist_like`'s per-writer style: the stroke affine (rotation, shear, scale,
    aspect), shift, thickness level and ink intensity of each writer."""
    rot = rng.uniform(-0.25, 0.25, num_writers)
    shear = rng.uniform(-0.3, 0.3, num_writers)
    scale = rng.uniform(0.8, 1.1, num_writers)
    aspect = rng.uniform(0.9, 1.1, num_writers)
    cos, sin = np.cos(rot), np.sin(rot)
    rotm = np.stack([np.stack([cos, -sin], -1), np.stack([sin, cos], -1)], -2)
    shape = np.zeros((num_writers, 2, 2))
    shape[:, 0, 0], shape[:, 0, 1], shape[:, 1, 1] = scale * aspect, shear * scale, scale / aspect
    affine = rotm @ shape  # (W, 2, 2)
    shift = rng.uniform(-2.5, 2.5, (num_writers, 2))
    thickness = rng.integers(0, len(_THICKNESS), num_writers)
    intensity = rng.uniform(0.6, 1.0, num_writers)
    return affine, shift, thickness, intensity


def _ink(imgs: np.ndarray, thickness: np.ndarray, intensity: np.ndarray) -> None:
    """In place: each image's stroke thickness (blur, then scaled so a stroke's centre line
    reaches ``_INK_GAIN``, clipped to 1) and ink intensity (``thickness``, ``intensity``:
    per image)."""
    from scipy.ndimage import gaussian_filter

    gain = np.empty(len(imgs), dtype=np.float32)
    for level, sigma in enumerate(_THICKNESS):
        sel = np.flatnonzero(thickness == level)
        if sel.size:
            imgs[sel] = gaussian_filter(imgs[sel], sigma=(0, sigma, sigma), truncate=3.0)
            gain[sel] = _INK_GAIN * np.sqrt(2 * np.pi) * sigma
    imgs *= gain[:, None, None]
    np.clip(imgs, 0.0, 1.0, out=imgs)
    imgs *= intensity.astype(np.float32)[:, None, None]


def _samples_of(
    imgs: np.ndarray, pair_of_sample: np.ndarray, out: np.ndarray, rng: np.random.Generator
) -> None:
    """Into ``out``: each sample's pair image shifted by -1/0/+1 px per axis, its intensity
    times U(0.85, 1), plus uniform pixel noise, clipped to [0, 1]."""
    padded = np.pad(imgs, ((0, 0), (1, 1), (1, 1)))  # shifts: windows of the padded images
    windows = np.lib.stride_tricks.sliding_window_view(padded, (_SIDE, _SIDE), axis=(1, 2))
    d = rng.integers(0, 3, size=(len(out), 2))
    out[...] = windows[pair_of_sample, d[:, 0], d[:, 1]]
    out *= rng.uniform(0.85, 1.0, size=(len(out), 1, 1)).astype(np.float32)
    noise = rng.integers(0, 256, size=out.shape, dtype=np.uint8).astype(np.float32)
    noise -= 127.5
    noise *= _NOISE_HALF_WIDTH / 127.5
    out += noise
    np.clip(out, 0.0, 1.0, out=out)


def _pairs(
    counts: np.ndarray, w0: int, w1: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (writer, class) pairs present among writers ``w0 .. w1 - 1`` (one image each):
    their writers and classes, and each sample's pair, in writer order (shuffled within a
    writer)."""
    num_classes = counts.shape[1]
    block = counts[w0:w1].ravel()
    present = np.flatnonzero(block)
    pair_writer = w0 + present // num_classes
    pair_class = present % num_classes
    pair_of_sample = np.repeat(np.arange(present.size), block[present])
    writer_of_sample = pair_writer[pair_of_sample]
    shuffle = np.argsort(writer_of_sample + rng.random(len(pair_of_sample)), kind="stable")
    return pair_writer, pair_class, pair_of_sample[shuffle]


def femnist_like(
    num_writers: int,
    rng: np.random.Generator,
    samples_per_writer: int | None = None,
    num_classes: int = 62,
) -> ClientData:
    """A FEMNIST-like federated image source (generated; no download).

    Mimics FEMNIST (LEAF, Caldas et al., 2018: handwritten characters in 62
    classes, one client per writer) for benchmarks:

    * class prototypes: ``num_classes`` glyphs of 1-3 random quadratic Bezier
      strokes, drawn from a child generator spawned from ``rng``;
    * per-writer style, applied to the strokes before rasterising: rotation
      (+-0.25 rad), shear (+-0.3), scale (0.8-1.1, aspect 0.9-1.1), shift
      (+-2.5 px), stroke thickness (Gaussian blur of sigma 0.5-1.1 px, then the
      ink is scaled so a stroke's centre reaches 1.6 and clipped to 1, so a
      stroke is about 2 sigma wide) and ink intensity (0.6-1.0);
    * per sample: a shift by -1/0/+1 px per axis, intensity x U(0.85, 1) and
      uniform pixel noise of standard deviation 0.08, clipped to [0, 1];
    * per-writer label skew: writer w draws labels from q_w ~ Dir(0.5 * 1_C);
    * sizes: ``samples_per_writer`` each, or else
      ``clip(round(LogNormal(ln 200, 0.5)), 10, 1000)`` (mean ~226, as FEMNIST).

    Each (writer, class) pair is rendered once and its samples are derived from
    that image, in batches of about 16384 samples.

    Returns one ``(x_k (n_k, 1, 28, 28) float32 in [0, 1], y_k (n_k,) int64)`` per writer.
    """
    check_count(num_writers, "num_writers")
    check_count(num_classes, "num_classes", 2)
    if samples_per_writer is not None:
        check_count(samples_per_writer, "samples_per_writer")
    glyph_rng, rng = rng.spawn(2)
    glyphs = _glyph_points(glyph_rng, num_classes)
    sizes, counts = _writer_counts(rng, num_writers, samples_per_writer, num_classes)
    affine, shift, thickness, intensity = _writer_styles(rng, num_writers)
    n = int(sizes.sum())
    x = np.empty((n, 1, _SIDE, _SIDE), dtype=np.float32)
    y = np.empty(n, dtype=np.int64)
    ends = np.cumsum(sizes)
    w0 = 0
    while w0 < num_writers:  # batches of whole writers holding about _CHUNK samples
        base = int(ends[w0 - 1]) if w0 else 0
        w1 = max(int(np.searchsorted(ends, base + _CHUNK, side="right")), w0 + 1)
        a, b = base, int(ends[w1 - 1])
        pair_writer, pair_class, pair_of_sample = _pairs(counts, w0, w1, rng)
        y[a:b] = pair_class[pair_of_sample]
        imgs = _render(glyphs[pair_class], affine[pair_writer], shift[pair_writer])
        _ink(imgs, thickness[pair_writer], intensity[pair_writer])
        _samples_of(imgs, pair_of_sample, x[a:b, 0], rng)
        w0 = w1
    return split_rows(x, y, sizes)
