"""A 4-bit matrix on the device, in the layout every int4 kernel reads (``kernels/q4.h``), stored once.

Codes: 32 per RGBA/UINT32 texel (``perfx.formats.pack_texels``), in one of two layouts chosen at load:

- ``LAYOUT_ROWS`` (0): rows contiguous along K, texel t of row r at r·(K/32) + t;
- ``LAYOUT_INTERLEAVED`` (1): texel t of row r at t·N + r, so GPU work-items that own neighbouring rows read
  neighbouring 16 bytes (the coalesced layout of llama.cpp's Adreno kernels, transposed once at load).

Each group's (s, m) is stored in the matrix's form (``Q4Matrix.form``, the kernels' ``Q4_SCALES``): half2
pairs, fp16 scales then 4-bit zero points, or fp16 scales alone (``perfx.formats.pack_group_scales``), in
the layout's group order: (N, K/G) or (K/G, N).

Every weight is on the device once. The codes are one buffer; the read paths are views of it where the
device has them: an image1d_buffer (core OpenCL 1.2) and image2d row blocks (cl_khr_image2d_from_buffer,
rows a multiple of the pitch alignment). Only where image2d cannot be a view (PoCL, Oclgrind, or an
unaligned row) are image2d row blocks a copy, and then they are the only copy: ask for "image2d" alone.
The layout is made once at load time; nothing is repacked per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from perfx.errors import PerfxError
from perfx.formats import (Q4_PAIRS, Q4Matrix, describe_q4_form, pack_group_scales, pack_texels, q4_form_defines,
                           q4_scale_bytes, row_splits)
from perfx.runtime import Device

READ_PATHS = ("buffer", "image2d", "image1d_buffer")
LAYOUT_ROWS, LAYOUT_INTERLEAVED = 0, 1
LAYOUT_NAMES = {LAYOUT_ROWS: "rows", LAYOUT_INTERLEAVED: "interleaved"}


def image2d_is_view(caps, k: int) -> bool:
    """Whether image2d row blocks of a K-wide weight can be views of its codes buffer on this device."""
    texels = k // 32
    return bool(caps.image_support and caps.image2d_from_buffer and caps.image_pitch_alignment
                and texels % caps.image_pitch_alignment == 0 and texels <= caps.image2d_max_width)


def image2d_fits(caps, k: int) -> bool:
    """Whether a K-wide weight fits image2d row blocks at all (a view or a copy)."""
    return bool(caps.image_support and k // 32 <= caps.image2d_max_width)


def image1d_fits(caps, n: int, k: int) -> bool:
    """Whether the codes of an (N, K) weight fit one image1d_buffer view."""
    return 0 < n * (k // 32) <= caps.image1d_buffer_texels


def available_paths(caps, n: int, k: int, layout: int = LAYOUT_ROWS) -> tuple[str, ...]:
    """The read paths an (N, K) weight of ``layout`` can have here without a second copy of its codes."""
    paths = ["buffer"]
    if image1d_fits(caps, n, k):
        paths.append("image1d_buffer")
    if layout == LAYOUT_ROWS and image2d_is_view(caps, k):
        paths.append("image2d")
    return tuple(paths)


def held_paths(caps, k: int, read_paths) -> set[str]:
    """The read paths a K-wide weight uploaded for ``read_paths`` holds (``Q4DeviceWeight.upload``): its codes
    buffer also where image2d row blocks are views of it."""
    asked = set(read_paths)
    held = asked & {"image2d", "image1d_buffer"}
    if asked & {"buffer", "image1d_buffer"} or ("image2d" in asked and image2d_is_view(caps, k)):
        held.add("buffer")
    return held


@dataclass
class Q4DeviceWeight:
    n: int
    k: int
    group: int
    scale_offset: object                 # cl.Buffer of the groups' scales in ``form``, (N, K/G) for LAYOUT_ROWS,
                                         # (K/G, N) interleaved (perfx.formats.pack_group_scales)
    layout: int = LAYOUT_ROWS
    form: int = Q4_PAIRS                 # how (s, m) is stored: kernels/q4.h's Q4_SCALES
    bias: object | None = None           # cl.Buffer of float (N), or None
    buffer: object | None = None         # cl.Buffer of uint4: the codes, once (None: image2d copies hold them)
    image1d: object | None = None        # image1d_buffer view of ``buffer``
    images: list = field(default_factory=list)             # image2d per row block (views of ``buffer`` or copies)
    image_rows: list[tuple[int, int]] = field(default_factory=list)  # [start, stop) of each image
    images_are_views: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads for one pass over the matrix (codes, the form's scales, bias)."""
        return (self.n * self.k // 2 + q4_scale_bytes(self.form, self.n * (self.k // self.group))
                + (4 * self.n if self.bias is not None else 0))

    @property
    def defines(self) -> dict:
        """The kernel defines this weight fixes beside the tuned ones: its scales' form where not the default."""
        return q4_form_defines(self.form)

    def describe_form(self) -> str:
        return describe_q4_form(self.form, self.group)

    @property
    def read_paths(self) -> tuple[str, ...]:
        """The read paths this weight was uploaded with."""
        return tuple(p for p, have in (("buffer", self.buffer is not None), ("image2d", bool(self.images)),
                                       ("image1d_buffer", self.image1d is not None)) if have)

    @classmethod
    def upload(cls, device: Device, q4: Q4Matrix, bias: np.ndarray | None = None,
               read_paths: tuple[str, ...] | None = None, what: str = "weight",
               layout: int = LAYOUT_ROWS) -> Q4DeviceWeight:
        """Upload ``q4`` in ``layout`` for the given read paths ("buffer", "image2d", "image1d_buffer").

        None: every path that needs no second copy here (``available_paths``). The codes are one buffer
        whenever a path needs it or image2d can view it; image2d row blocks are copies only where they
        cannot be views, and then no buffer is made unless "buffer" or "image1d_buffer" is asked for too.
        """
        n, k = q4.shape
        caps = device.caps
        if layout not in LAYOUT_NAMES:
            raise PerfxError(f"{what}: layout {layout!r}; perfx knows {LAYOUT_NAMES}")
        read_paths = available_paths(caps, n, k, layout) if read_paths is None else tuple(read_paths)
        unknown = set(read_paths) - set(READ_PATHS)
        if unknown:
            raise PerfxError(f"unknown read path(s) {sorted(unknown)}; perfx knows {READ_PATHS}")
        if "image2d" in read_paths:
            if layout != LAYOUT_ROWS:
                raise PerfxError(f"{what}: image2d row blocks hold rows contiguous along K (layout 0), not the "
                                 "interleaved layout; read it through 'buffer' or 'image1d_buffer'")
            if not caps.image_support:
                raise PerfxError(f"{caps.name} has no image support: load {what} with read path 'buffer'")
            if not image2d_fits(caps, k):
                raise PerfxError(f"{what}: K = {k} needs {k // 32} texels per row, more than the image width "
                                 f"limit {caps.image2d_max_width}; use read path 'buffer'")
        if "image1d_buffer" in read_paths and not image1d_fits(caps, n, k):
            raise PerfxError(f"{what}: {n * (k // 32)} texels do not fit one image1d_buffer here (limit "
                             f"{caps.image1d_buffer_texels}); use read path 'buffer'")

        texels = pack_texels(q4.codes)  # (N, K/32, 4) uint32
        scales = pack_group_scales(q4, interleaved=layout == LAYOUT_INTERLEAVED)
        if layout == LAYOUT_INTERLEAVED:
            texels = texels.transpose(1, 0, 2)
        weight = cls(n, k, q4.group, device.alloc(scales.nbytes, scales, what=f"{what} scales"), layout, q4.form)
        if bias is not None:
            bias = np.asarray(bias, dtype=np.float32)
            if bias.shape != (n,):
                raise PerfxError(f"{what}: bias of shape {bias.shape} for a matrix with {n} rows")
            weight.bias = device.alloc(bias.nbytes, bias, what=f"{what} bias")

        image2d = "image2d" in read_paths
        views = image2d and image2d_is_view(caps, k)
        if {"buffer", "image1d_buffer"} & set(read_paths) or views:
            weight.buffer = device.alloc(texels.nbytes, texels, what=f"{what} codes")
        if "image1d_buffer" in read_paths:
            weight.image1d = device.image1d_view(weight.buffer, n * (k // 32), what=f"{what} image1d_buffer view")
        if image2d:
            # Rows per image: the height limit, and (copies) the allocation limit for very long rows.
            max_rows = caps.image2d_max_height if views else \
                max(1, min(caps.image2d_max_height, caps.max_alloc // (16 * (k // 32))))
            weight.images_are_views = views
            for start, stop in row_splits(n, max_rows):
                if views:
                    image = device.image2d_view(weight.buffer, k // 32, stop - start, start,
                                                what=f"{what} rows {start}:{stop}")
                else:
                    image = device.image_rgba_u32(texels[start:stop], what=f"{what} rows {start}:{stop}")
                weight.images.append(image)
                weight.image_rows.append((start, stop))
        return weight
