"""Decode of a synthetic mixture of experts with its layers cut to a few (a whole preset's memory does not fit a CPU
runtime shared with other sessions): greedy decode tok/s in interleaved rounds against the same model without its
shared expert, and the bytes a decode step reads (``Model.weight_bytes``) against the active parameters' bytes
counted from the config (every non-expert weight, the router, the chosen experts and the shared expert).

    python benchmarks/moe_decode.py synthetic:qwen3.5-35b-a3b --layers 4 --device intel --rounds 3 --tokens 16
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from perfx.model import Model
from perfx.runtime import Device
from perfx.sources.synthetic import SYNTHETIC_MODELS, SyntheticSource
from perfx.tuning.database import default_database

INT4_BYTES = 0.5 + 4 / 32   # a synthetic int4 weight: half a byte, and an fp16 (scale, offset) pair per 32


def active_bytes(c, head_bytes: int) -> tuple[int, int]:
    """(active parameters, their bytes) of one decode step, from the config alone: int4 matrices at INT4_BYTES,
    the router, the shared expert's gate and the norms in float32, the lm_head as loaded (``head_bytes``)."""
    h, params, nbytes = c.hidden_size, 0, 0.0
    for i, r in enumerate(c.layers):
        if r.kind == "attention":
            matrices = h * (2 * c.q_dim + 2 * c.kv_dim) + c.q_dim * h
            floats = 2 * c.head_dim
        else:   # Gated DeltaNet: q|k|v, z, a, b, out; its taps, dt_bias, A and norm
            matrices = h * (c.delta_conv_dim + c.delta_value_dim + 2 * c.delta_v_heads) + c.delta_value_dim * h
            floats = c.delta_conv_dim * c.conv_length + 2 * c.delta_v_heads + c.delta_v_dim
        experts = 3 * h * (c.n_experts_used * c.expert_intermediate + c.expert_shared)
        floats += 2 * h + c.n_experts * h + (h if c.expert_shared_gate else 0)
        params += matrices + experts + floats
        nbytes += INT4_BYTES * (matrices + experts) + 4 * floats
    params += 2 * c.vocab_size * h + h    # the embedding row's table counted as the head, and the final norm
    return params, int(nbytes + head_bytes + INT4_BYTES * h + 4 * h)


def load(config, name: str, device: Device) -> Model:
    return Model.load(SyntheticSource(name, config, 32), device, ctx=256, progress=False,
                      database=default_database(False))


def decode_rate(model: Model, tokens: int) -> float:
    model.prefill([1, 2, 3, 4], 0)
    started = time.perf_counter()
    for _ in model.greedy_tokens(5, 4, 4 + tokens):
        pass
    return tokens / (time.perf_counter() - started)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a synthetic mixture of experts, e.g. synthetic:qwen3.5-35b-a3b")
    parser.add_argument("--layers", type=int, default=4, help="the first N layers of the preset's recipe")
    parser.add_argument("--device", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    name = args.model.removeprefix("synthetic:")
    base = SYNTHETIC_MODELS[name][0]
    config = dataclasses.replace(base, n_layers=args.layers, layers=base.layers[:args.layers])
    device = Device(args.device)
    models = {"with shared expert": load(config, name, device)}
    if config.expert_shared:
        models["without"] = load(dataclasses.replace(config, expert_shared=0, expert_shared_gate=False), name, device)
    model = models["with shared expert"]
    params, want = active_bytes(config, model.weights.lm_head.nbytes)
    print(f"{device.caps.name}: {name}, its first {args.layers} of {base.n_layers} layers")
    print(f"  bytes a decode step reads: {model.weight_bytes / 1e6:.1f} MB (Model.weight_bytes); active parameters "
          f"{params / 1e6:.1f} M, {want / 1e6:.1f} MB counted from the config: ratio {model.weight_bytes / want:.3f}")
    print(f"  device memory {device.allocated_bytes / 1e9:.2f} GB (both models)")
    rates = {label: [] for label in models}
    for _ in range(args.rounds):
        for label, m in models.items():
            rates[label].append(decode_rate(m, args.tokens))
    for label, samples in rates.items():
        print(f"  decode tok/s {label:20s} {np.median(samples):7.2f} ({', '.join(f'{r:.2f}' for r in samples)})")
    if len(rates) > 1:
        ratio = np.median(rates["with shared expert"]) / np.median(rates["without"])
        print(f"  with / without the shared expert: {ratio:.2f}x")


if __name__ == "__main__":
    main()
