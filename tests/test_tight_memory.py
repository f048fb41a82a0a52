"""Tight memory: the synthetic Llama-2-7B (AWQ's int4 form: group 128, 4-bit zero points) under an Adreno
740's limits (PERFX_LIMITS=adreno740: one allocation ≤ 1 GiB, image2d ≤ 16384 × 16384) loads and decodes, no
single allocation or image breaks a limit, and its device memory, with the token embedding in the same int4 form
(``--embedding q4``), is below PerfXLLM's 3.7 GB for the same model at 128 positions and at most 4.8 GB at 4096
with the int8 cache; it also runs 8192 positions. A few minutes on two CPU cores: slow.
"""

import copy
import dataclasses
import gc
import time

import numpy as np
import pytest

from perfx.formats import Q4_ZEROS
from perfx.model import Model
from perfx.ops.gemv_q4 import GemvQ4
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.runtime import LIMIT_PRESETS, Device
from perfx.sources import open_model
from perfx.tuning.spec import relative_error

PERFXLLM_BYTES = 3.7e9   # PerfXLLM's Llama-7B AWQ int4 on a Snapdragon 8 Gen 2 (DESIGN.md)
LONG_CONTEXT_BYTES = 4.8e9   # the goal at 4096 positions with the int8 cache
CTX = 128
DECODE_TOKENS = 3


class Recorder:
    """Every allocation and image the device makes, through its one size check."""

    def __init__(self, device: Device):
        self.largest, self.largest_what, self.images = 0, "", []
        check, image = device._check_alloc, device.image_rgba_u32

        def recorded_check(nbytes, what):
            if nbytes > self.largest:
                self.largest, self.largest_what = nbytes, what
            return check(nbytes, what)

        def recorded_image(texels, what="an image"):
            self.images.append((what, texels.shape[1], texels.shape[0]))   # (what, width, height)
            return image(texels, what)

        device._check_alloc, device.image_rgba_u32 = recorded_check, recorded_image


@pytest.fixture(scope="module")
def llama_7b():
    """synthetic:llama-2-7b with its token embedding in AWQ's int4 form (``--embedding q4``): its random embedding
    and lm_head (131M values each) quantized once for the module's loads, and its one random layer made once (the
    source reuses it for every layer). Each test loads it on a device of its own: every layer, both tables and the
    cache uploaded and counted as `perfx generate --model synthetic:llama-2-7b --embedding q4` would."""
    source = open_model("synthetic:llama-2-7b", embedding="q4")
    embedding, head = source.embedding(), source.lm_head()
    source.embedding, source.lm_head = (lambda: embedding), (lambda: head)
    return source


def with_config(source, **changes):
    """The source with its config changed, sharing the tables and the layer made once."""
    changed = copy.copy(source)
    changed.config = dataclasses.replace(source.config, **changes)
    return changed


@pytest.mark.slow
def test_llama_2_7b_loads_and_decodes_under_adreno740_limits(llama_7b):
    gc.collect()
    device = Device(limits=LIMIT_PRESETS["adreno740"])
    caps = device.caps
    # PoCL's own image height (8192) is below the preset's 16384: the lower of the two is in force.
    assert (caps.max_alloc, caps.limits) == (1 << 30, "adreno740") and caps.image2d_max_height <= 16384
    seen = Recorder(device)
    started = time.perf_counter()
    source = llama_7b
    model = Model.load(source, device, ctx=CTX, progress=False)
    load_s = time.perf_counter() - started
    c = source.config
    assert (c.hidden_size, c.n_layers, c.vocab_size) == (4096, 32, 32000)

    # No allocation over the limit, and no image over the height limit: tall matrices are split in row blocks.
    assert 0 < seen.largest <= caps.max_alloc
    assert all(w <= caps.image2d_max_width and h <= caps.image2d_max_height for _, w, h in seen.images)
    gate_up = model.weights.layers[0].gate_up.weight
    assert isinstance(gate_up, Q4DeviceWeight) and gate_up.n == 2 * 11008
    if "image2d" in model.plan.read_paths:   # 22016 rows: more than one image's height
        height = caps.image2d_max_height
        assert [stop - start for start, stop in gate_up.image_rows][0] == height and len(gate_up.images) > 1
    # Every layer and the token embedding in AWQ's form (2.5 bytes a group); the int8 lm_head in one block.
    assert all(linear.weight.form == Q4_ZEROS for linear in model.weights.linears()
               if isinstance(linear.weight, Q4DeviceWeight))
    embedding = model.weights.embedding.weight
    assert isinstance(embedding, Q4DeviceWeight) and embedding.form == Q4_ZEROS
    assert len(model.weights.lm_head.weight.blocks) == 1
    assert device.peak_allocated_bytes >= device.allocated_bytes > model.weight_bytes

    # Decode a few tokens from a short prompt; ids and logits must be sane.
    prompt = [1, 450, 7483, 310]
    started = time.perf_counter()
    model.prefill(prompt, 0)
    token = model.argmax()
    device.queue.finish()
    prefill_s = time.perf_counter() - started
    after_prefill = device.allocated_bytes   # the first prefill of an M bucket builds its GEMMs: a few bytes
    assert after_prefill - model.load_report["device_bytes"] < 1 << 20
    started = time.perf_counter()
    tokens = [token]
    for i in range(DECODE_TOKENS):
        model.decode_one(tokens[-1], len(prompt) + i)
        tokens.append(model.argmax())
    decode_s = time.perf_counter() - started
    logits = model.logits()
    assert all(0 <= t < c.vocab_size for t in tokens) and np.all(np.isfinite(logits)) and logits.std() > 0

    after = device.allocated_bytes
    assert after == after_prefill   # decoding allocates nothing
    assert after < PERFXLLM_BYTES, f"{after / 1e9:.3f} GB on the device"

    # The image read path (the one an Adreno is tuned to; PoCL's defaults read buffers): the 22016-row gate_up
    # goes into row blocks of at most the image height, and the GEMV over them equals the buffer path's.
    w = source.layer(0).gate_up
    images = Q4DeviceWeight.upload(device, w, read_paths=("image2d",), what="gate_up (image path)")
    height = caps.image2d_max_height
    assert images.image_rows[0] == (0, height) and images.image_rows[-1][1] == w.shape[0]
    assert max(stop - start for start, stop in images.image_rows) <= height and len(images.images) >= 2
    x = device.upload(np.random.default_rng(0).standard_normal(c.hidden_size).astype(np.float32))
    y_image, y_buffer = (device.empty(c.intermediate_size, np.float32) for _ in range(2))
    # The buffer copy in the same (rows) layout: the model's own may be interleaved where that was tuned faster.
    rows = Q4DeviceWeight.upload(device, w, read_paths=("buffer",), what="gate_up (buffer path)")
    shape = {"epilogue": "silu_mul"}   # the defaults that fit a gate-up, with each read path
    GemvQ4(device, {"READ": 1, "ROWS": 2}, shape)(images, x, y_image, "silu_mul")
    GemvQ4(device, {"READ": 0, "ROWS": 2}, shape)(rows, x, y_buffer, "silu_mul")
    assert relative_error(y_image.get(), y_buffer.get().astype(np.float64)) < 1e-5
    del images, rows
    tok_s = DECODE_TOKENS / decode_s
    figures = {
        "load_s": round(load_s, 1), "device_bytes": after, "device_gb": round(after / 1e9, 3),
        "vs_perfxllm_3.7GB": round(after / PERFXLLM_BYTES, 3), "weight_bytes": model.weight_bytes,
        "kv_cache_bytes": model.cache.nbytes, "ctx": CTX, "largest_allocation": seen.largest,
        "largest_what": seen.largest_what, "image_blocks_gate_up": len(seen.images),
        "read_paths": list(model.plan.read_paths),
        "prefill_s": round(prefill_s, 2), "decode_tok_s": round(tok_s, 3),
        "decode_gb_s": round(model.weight_bytes * tok_s / 1e9, 2),
        "host_peak_bytes": model.load_report["host_peak_bytes"],
    }
    print(f"\ntight memory (adreno740 limits), synthetic:llama-2-7b: {figures}")


@pytest.mark.slow
def test_llama_2_7b_runs_a_4096_position_context_under_256_mib_allocations(llama_7b):
    """adreno-qcs allows 256 MiB per allocation: the 7B's keys (and values) at 4096 positions, 32 MiB a layer, are
    held in pieces of 8 whole layers (each exactly the limit), and decode reads the right piece at every layer up to
    the last position. Nine of the 7B's layers: what is tested does not depend on the other 23. Every layer has the
    same shapes, so the largest allocation is the same with 9 as with 32 (a layer's weights, or a piece of the cache,
    whose size comes from the limit, not the layer count), the positions are the same, and 9 layers make a full
    piece and a last one of a single layer, so a layer is read from a piece other than the first and from a piece
    that is not full (with 32, four full pieces)."""
    gc.collect()
    device = Device(limits=LIMIT_PRESETS["adreno-qcs"])
    seen = Recorder(device)
    layers = 9
    assert llama_7b.config.n_layers == 32
    source = with_config(llama_7b, n_layers=layers, layers=llama_7b.config.layers[:layers])
    model = Model.load(source, device, ctx=4096, progress=False)
    cache = model.cache
    assert cache.nbytes == layers << 26 and cache.layers_per_piece == (256 << 20) // (1 << 25) == 8
    assert len(cache.pieces) == 2 and all(b.size <= 256 << 20 for piece in cache.pieces for b in piece)
    assert cache.pieces[0][0].size == 256 << 20
    assert 0 < seen.largest <= 256 << 20
    cache.clear(device)              # positions 4..4094 are read below without having been written
    model.prefill([1, 2, 3], 0)
    first = model.logits()
    for pos in (3, 4095):            # the first free position, and the context's last
        model.decode_one(7, pos)
        assert np.isfinite(model.logits()).all()
    model.prefill([1, 2, 3], 0)      # the cache's first positions again: the same logits as before
    assert relative_error(model.logits(), first) <= 1e-5
    del model
    gc.collect()


def _decode_near_the_end(model, ctx: int) -> np.ndarray:
    """Prefill a short prompt, then decode at the context's last positions; the logits of each step are finite."""
    model.cache.clear(model.device)   # the positions in between are read without having been written
    model.prefill([1, 450, 7483], 0)
    assert np.isfinite(model.logits()).all()
    for pos in (ctx - 2, ctx - 1):
        model.decode_one(7, pos)
        logits = model.logits()
        assert np.isfinite(logits).all() and logits.std() > 0
    return logits


@pytest.mark.slow
def test_llama_2_7b_at_4096_positions_with_the_int8_cache_under_adreno740_limits(llama_7b):
    """`PERFX_LIMITS=adreno740 python -m perfx bench --model synthetic:llama-2-7b --e2e --ctx 4096 --kv q8
    --embedding q4`: at most 4.8 GB on the device, decoding at the context's last position."""
    gc.collect()
    device = Device(limits=LIMIT_PRESETS["adreno740"])
    model = Model.load(llama_7b, device, ctx=4096, progress=False, kv="q8")
    _decode_near_the_end(model, 4096)
    used = device.allocated_bytes
    print(f"\nsynthetic:llama-2-7b, ctx 4096, kv q8, embedding q4: {used} bytes ({used / 1e9:.3f} GB) on the "
          f"device, KV cache {model.cache.nbytes}")
    assert used <= LONG_CONTEXT_BYTES, f"{used / 1e9:.3f} GB on the device"
    del model
    gc.collect()


@pytest.mark.slow
def test_llama_2_7b_shapes_run_8192_positions_under_adreno740_limits(llama_7b):
    """The 7B's shapes with an 8192-position context (Llama-2-7B itself has 4096: its config here is raised as a
    long-context fine-tune's would be) and the int8 cache of 2.3 GB in pieces of at most 1 GiB: a short prefill,
    then decode at positions 8190 and 8191."""
    gc.collect()
    device = Device(limits=LIMIT_PRESETS["adreno740"])
    model = Model.load(with_config(llama_7b, max_positions=8192), device, ctx=8192, progress=False, kv="q8")
    assert model.cache.nbytes > 2 << 30 and all(b.size <= device.caps.max_alloc for piece in model.cache.pieces for b in piece)
    _decode_near_the_end(model, 8192)
    print(f"\nsynthetic:llama-2-7b shapes, ctx 8192, kv q8, embedding q4: {device.allocated_bytes / 1e9:.3f} GB")
    del model
    gc.collect()
