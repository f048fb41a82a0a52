"""A synthetic model loaded once on one device: the device memory at ``--ctx``, the bytes a decode step reads
(``Model.weight_bytes``) against the active parameters' bytes counted here from the host weights, and decode and
prefill tok/s over a few tokens (``perfx.commands.bench.measure_e2e``), with the copy bandwidth measured beside
each round.

The active parameters are counted apart from the model: every weight of a layer (its mixer's matrices and vectors,
its norms, a dense MLP, Gemma 4's per-layer gate and projection), a MoE layer's router and bias and
``n_experts_used`` of its experts (MXFP4 at the file's 17 bytes a block of 32); one row of Gemma 4's per-layer
table and its projection of the embedding; the final norm and the head, as the source hands them to the model.

``perfx bench --e2e`` builds and times a model twice (a cold run of its prompt first); this script loads once,
builds every kernel on a short run, and times ``--prompt`` and ``--decode`` tokens, so a model of several GB
finishes on a loaded machine. ``--layers`` keeps the first L layers of the preset (its real shapes, fewer of them)
where the whole model is too slow to time; ``--no-time`` loads and reports memory and bytes only. Run under a
phone's limits with PERFX_LIMITS (an Adreno's 1 GiB allocations):

    PERFX_LIMITS=adreno740 python benchmarks/synthetic_decode.py synthetic:lfm2-8b-a1b --device intel --ctx 4096
    PERFX_LIMITS=adreno740 python benchmarks/synthetic_decode.py synthetic:gemma-4-e2b --device pocl --layers 7
    python benchmarks/synthetic_decode.py synthetic:lfm2-8b-a1b --layers 6 --baseline synthetic:lfm2-1.2b

Gemma 4's per-layer table (E2B's is 262 144 × 35 × 256 values) is made up for this run: the synthetic source
otherwise leaves tables over ``PER_LAYER_TABLE_LIMIT`` values out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from perfx.commands.bench import measure_e2e
from perfx.model import Model, host_peak_bytes
from perfx.runtime import Device
from perfx.sources import synthetic
from perfx.timing import copy_bandwidth
from perfx.tuning.database import Database


def matrix_bytes(w) -> int:
    """Bytes of a host weight in its file's form: MXFP4 17 bytes a block of 32, else the form's own ``nbytes``."""
    if getattr(w, "mxfp4", False):
        return w.shape[0] * w.shape[1] // 32 * 17
    return int(w.nbytes)


def weight_count(w) -> int:
    return int(np.prod(w.shape))


def tree(value) -> tuple[int, int]:
    """(parameters, bytes) of every weight under ``value``: a matrix or vector, a dataclass or dict of them."""
    if value is None:
        return 0, 0
    if hasattr(value, "nbytes") and hasattr(value, "shape"):
        return weight_count(value), matrix_bytes(value)
    if dataclasses.is_dataclass(value):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        parts = [tree(v) for v in value.values()]
        return sum(p for p, _ in parts), sum(b for _, b in parts)
    raise TypeError(f"no weight count for {type(value).__name__}")


def moe_active(m, used: int) -> tuple[int, int]:
    """(parameters, bytes) a token reads of a MoE layer: the router, its biases, ``used`` experts (each expert's
    matrices and their biases' rows), the shared expert and its gate."""
    params, nbytes = tree({"router": m.router, "bias": m.selection_bias, "router_bias": m.router_bias,
                           "shared_gate_up": m.shared_gate_up, "shared_down": m.shared_down,
                           "shared_gate": m.shared_gate})
    for matrices, bias in ((m.gate_up, m.gate_up_bias), (m.down, m.down_bias)):
        params += used * weight_count(matrices[0])
        nbytes += used * matrix_bytes(matrices[0])
        if bias is not None:
            params += used * bias.shape[1]
            nbytes += used * bias[0].nbytes
    return params, nbytes


def active(source, recorded: dict) -> tuple[int, int]:
    """(parameters, bytes) one decode step reads, from the host weights (see the module's docstring)."""
    c, params, nbytes = source.config, 0, 0
    for i in range(c.n_layers):
        w = source.layer(i)
        fields = {f.name: getattr(w, f.name) for f in dataclasses.fields(w) if f.name != "moe"}
        p, b = tree(fields)
        if w.moe is not None:
            mp, mb = moe_active(w.moe, c.n_experts_used)
            p, b = p + mp, b + mb
        params, nbytes = params + p, nbytes + b
    p, b = tree(source.final_norm())
    return params + p + recorded["params"], nbytes + b + recorded["bytes"]


def record_tables(source) -> dict:
    """Counts, as the model loads them, of the head (the embedding where tied) and of Gemma 4's per-layer tables
    (one row of the token table, the projection and its norm), so the count needs no second copy of them."""
    recorded = {"params": 0, "bytes": 0}
    head, embedding, tables = source.lm_head, source.embedding, source.per_layer_tables

    def counted(w, params: int, nbytes: int):
        recorded["params"] += params
        recorded["bytes"] += nbytes
        return w

    def lm_head():
        w = head()
        return w if w is None else counted(w, *tree(w))

    def tied_embedding():
        w = embedding()
        return counted(w, *tree(w)) if source.config.tie_embeddings else w

    def per_layer_tables():
        t = tables()
        if t is None:
            return t
        table, projection, norm = t
        rest = tree({"projection": projection, "norm": norm})
        return counted(t, table.shape[1] + rest[0], matrix_bytes(table) // table.shape[0] + rest[1])

    source.lm_head, source.embedding, source.per_layer_tables = lm_head, tied_embedding, per_layer_tables
    return recorded


def load(parser, model: str, layers: int | None, device: Device, ctx: int):
    """``model`` (a synthetic preset, its first ``layers``) on ``device``: (Model, active parameters, their bytes,
    what the load measured)."""
    name = model.removeprefix(synthetic.SYNTHETIC_PREFIX)
    if name not in synthetic.SYNTHETIC_MODELS:
        parser.error(f"unknown synthetic model {model!r}; known: {', '.join(synthetic.SYNTHETIC_MODELS)}")
    config, group, form = synthetic.SYNTHETIC_MODELS[name]
    layers = layers or config.n_layers
    if not 0 < layers <= config.n_layers:
        parser.error(f"--layers {layers}: {model} has {config.n_layers} layers")
    whole = config.n_layers
    config = dataclasses.replace(config, n_layers=layers, layers=config.layers[:layers])
    source = synthetic.SyntheticSource(name, config, group, form=form, experts=synthetic.SYNTHETIC_EXPERTS[name])
    recorded = record_tables(source)
    before = device.allocated_bytes
    loaded = Model.load(source, device, ctx=ctx, progress=False, database=Database(None))
    params, want = active(source, recorded)
    report = loaded.load_report
    return loaded, params, {
        "model": model, "device": f"{device.caps.name} ({device.entry.platform})", "limits": device.caps.limits,
        "layers": layers, "of_layers": whole, "ctx": ctx, "load_s": report["load_s"],
        "weight_bytes": loaded.weight_bytes, "active_bytes": want, "active_params": params,
        "weight_over_active": loaded.weight_bytes / want, "device_bytes": device.allocated_bytes - before,
        "kv_cache_bytes": report["kv_cache_bytes"], "conv_state_bytes": report["conv_state_bytes"],
        "max_alloc": device.caps.max_alloc}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a synthetic preset, e.g. synthetic:lfm2-8b-a1b")
    parser.add_argument("--device", default=None)
    parser.add_argument("--layers", type=int, default=None, help="the first L layers of the preset (default: all)")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--decode", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", help="a synthetic model (whole) timed in the same rounds, interleaved")
    parser.add_argument("--no-time", action="store_true", help="load, report memory and bytes, time nothing")
    args = parser.parse_args()
    if args.baseline == args.model:
        parser.error("--baseline names the model measured; name another, e.g. a dense model of its family")
    synthetic.PER_LAYER_TABLE_LIMIT = 1 << 40
    device = Device(args.device)
    models = {}
    for name, layers in [(args.model, args.layers)] + ([(args.baseline, None)] if args.baseline else []):
        model, params, out = load(parser, name, layers, device, args.ctx)
        models[name] = model, params, out
        print(json.dumps(out), flush=True)
    if not args.no_time:
        # each model's peak above what it holds loaded, so a baseline's bytes and the copy's buffers stay out
        extra = dict.fromkeys(models, 0)
        for name, (model, _, _) in models.items():
            device.peak_allocated_bytes = device.allocated_bytes
            measure_e2e(model, args.prompt, 2)   # builds every kernel, not timed
            extra[name] = max(extra[name], device.peak_allocated_bytes - device.allocated_bytes)
        for round_ in range(args.rounds):
            for name, (model, params, _) in models.items():
                copy_gb_s, _ = copy_bandwidth(device)
                device.peak_allocated_bytes = device.allocated_bytes
                r = measure_e2e(model, args.prompt, args.decode)
                extra[name] = max(extra[name], device.peak_allocated_bytes - device.allocated_bytes)
                print(json.dumps({"round": round_, "model": name, "copy_gb_s": copy_gb_s,
                                  "decode_of_copy": r["decode_gb_s"] / copy_gb_s,
                                  "prefill_gflop_s": 2 * params * r["prefill_tok_s"] / 1e9,
                                  **{k: r[k] for k in ("prompt_tokens", "decode_tokens", "prefill_tok_s",
                                                       "decode_tok_s", "decode_gb_s", "host_ms_per_token",
                                                       "launches_per_token")}}), flush=True)
        for name, (_, _, out) in models.items():
            print(json.dumps({"model": name, "device_peak_bytes": out["device_bytes"] + extra[name]}), flush=True)
    print(json.dumps({"host_peak_bytes": host_peak_bytes()}), flush=True)


if __name__ == "__main__":
    main()
