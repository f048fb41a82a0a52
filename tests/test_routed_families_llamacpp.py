"""The mixtures of experts, Gemma 4 and Gemma 3n give llama.cpp's greedy answers on their tiny files.

``tests/data/llamacpp_routed_families.json`` holds what llama.cpp 0.3.36's CPU backend answered on the file each
family's writer makes at a recorded seed (``benchmarks/routed_families_llamacpp.py`` chose the seed where both
llama.cpp and the float64 forward call every greedy step by at least 0.2 logits, so rounding cannot part them).
perfx's device decode (the shipped tuning, as a user runs it) must give the same tokens on each implementation.
Where llama.cpp is installed, it must still give them (it is benchmark-only: skipped without it).
"""

import json
from pathlib import Path

import pytest

from helpers.llamacpp import INSTALL, import_llama_cpp
from helpers.llamacpp_files import WRITERS
from perfx.model import Model
from perfx.sources import open_model
from perfx.tuning.database import default_database

RECORDED = json.loads((Path(__file__).parent / "data" / "llamacpp_routed_families.json").read_text())


@pytest.mark.parametrize("family", sorted(RECORDED["families"]))
def test_device_greedy_tokens_are_llama_cpps(tmp_path, device, family):
    entry = RECORDED["families"][family]
    path = WRITERS[family](tmp_path / f"{family}.gguf", entry["seed"])
    prompt, want = entry["prompt_ids"], entry["greedy"]
    model = Model.load(open_model(path), device, ctx=64, progress=False, database=default_database(False))
    model.prefill(prompt[:-1], 0)
    got = list(model.greedy_tokens(prompt[-1], len(prompt) - 1, len(prompt) - 1 + len(want)))
    assert got[:len(want)] == want


@pytest.mark.parametrize("family", sorted(RECORDED["families"]))
def test_llama_cpp_still_gives_the_recorded_answers(tmp_path, family):
    pytest.importorskip("llama_cpp", reason=INSTALL)
    entry = RECORDED["families"][family]
    path = WRITERS[family](tmp_path / f"{family}.gguf", entry["seed"])
    llm = import_llama_cpp().Llama(model_path=str(path), n_ctx=256, n_batch=256, n_threads=2, n_threads_batch=2,
                                   logits_all=True, n_gpu_layers=0, verbose=False)
    llm.eval(entry["prompt_ids"])
    tokens = []
    for _ in entry["greedy"]:
        tokens.append(int(llm.scores[llm.n_tokens - 1].argmax()))
        llm.eval([tokens[-1]])
    assert tokens == entry["greedy"]
