"""Decode of the synthetic gpt-oss-20b on one device: tok/s, the bytes a decode step reads (``Model.weight_bytes``)
against the active parameters' bytes counted here from the host weights (every non-expert tensor of a layer, the
router, and the chosen experts' matrices and biases, 4 of 32; the head), and the device memory at ``--ctx``.

The whole model is 24 layers of 32 experts in MXFP4, held as the file holds them (e2m1 nibbles and an E8M0 byte a
group of 32: about 10 GB of experts; on a CPU runtime device memory is the host's); ``--layers`` keeps the first L
layers (the real shapes, fewer of them) where the machine has less. Run under phone limits with PERFX_LIMITS (an Adreno's 1 GiB allocations):

    PERFX_LIMITS=adreno740 python benchmarks/gptoss_decode.py --device intel --layers 4 --ctx 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from perfx.commands.bench import measure_e2e
from perfx.model import Model
from perfx.runtime import Device
from perfx.sources.synthetic import SYNTHETIC_EXPERTS, SYNTHETIC_MODELS, SyntheticSource
from perfx.tuning.database import Database


def matrix_bytes(w) -> int:
    """Bytes of a host matrix in its file's form: MXFP4 17 bytes a block of 32 (counted here, apart from the model's
    device form), else the form's own (``nbytes``)."""
    if getattr(w, "mxfp4", False):
        return w.shape[0] * w.shape[1] // 32 * 17
    return w.nbytes


def active_bytes(source) -> int:
    """Bytes of the parameters a token reads, from the host weights: each layer's attention (qkv, o, their biases,
    the sinks), norms, router and its bias, ``n_experts_used`` experts' gate-up and down with their biases; the
    final norm and the head."""
    c, total = source.config, 0
    for i in range(c.n_layers):
        w = source.layer(i)
        m, a = w.moe, w.mixing
        total += sum(x.nbytes for x in (a.qkv, a.o, a.qkv_bias, a.o_bias, a.sinks, w.attn_norm, w.ffn_norm)
                     if x is not None)
        total += m.router.nbytes + (0 if m.router_bias is None else m.router_bias.nbytes)
        per_expert = matrix_bytes(m.gate_up[0]) + matrix_bytes(m.down[0])
        if m.gate_up_bias is not None:
            per_expert += m.gate_up_bias[0].nbytes + m.down_bias[0].nbytes
        total += c.n_experts_used * per_expert
    head = source.lm_head()
    return total + source.final_norm().nbytes + (source.embedding() if head is None else head).nbytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config, group, form = SYNTHETIC_MODELS["gpt-oss-20b"]
    config = dataclasses.replace(config, n_layers=args.layers, layers=config.layers[:args.layers])
    source = SyntheticSource("gpt-oss-20b", config, group, form=form, experts=SYNTHETIC_EXPERTS["gpt-oss-20b"])
    device = Device(args.device)
    model = Model.load(source, device, ctx=args.ctx, progress=False, database=Database(None))
    measure_e2e(model, args.prompt, 2)   # builds every kernel first
    rounds = [measure_e2e(model, args.prompt, args.decode) for _ in range(args.rounds)]
    decode = sorted(r["decode_tok_s"] for r in rounds)
    out = {"device": device.caps.name, "layers": args.layers, "ctx": args.ctx,
           "decode_tok_s": {"median": decode[len(decode) // 2], "min": decode[0], "max": decode[-1]},
           "prefill_tok_s": sorted(r["prefill_tok_s"] for r in rounds)[len(rounds) // 2],
           "weight_bytes": model.weight_bytes, "active_bytes": active_bytes(source),
           "device_bytes": rounds[-1]["device_bytes"], "device_peak_bytes": rounds[-1]["device_peak_bytes"],
           "kv_cache_bytes": rounds[-1]["kv_cache_bytes"]}
    out["weight_over_active"] = out["weight_bytes"] / out["active_bytes"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
