"""The command line as a user runs it: info, selftest (passing, and failing on a broken kernel), generate."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from perfx import cli
from perfx.commands import selftest
from perfx.commands.info import describe_weight
from perfx.formats import Q8Matrix
from perfx.runtime import KernelLimitError
from perfx.tuning import SPECS


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A selftest's progress file (kept by an interrupted run, resumed by the next) in the test's own folder."""
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path))


def test_info_json_names_a_device(capsys):
    code, out, _ = run_cli(capsys, "info", "--json")
    data = json.loads(out)
    assert code == 0 and data["chosen"]["name"] and data["capabilities"]["max_alloc"] > 0
    assert data["chosen"]["reason"]
    if "cl_khr_command_buffer" in data["capabilities"]["extensions"]:
        assert "PERFX_COMMAND_BUFFER=on" in data["decode_step"] or "provisional" in data["decode_step"]
    else:
        assert data["decode_step"] == "one enqueue a launch: the driver has no cl_khr_command_buffer"
    assert data["replay"]["mode"] == data["decode_step"] and data["replay"]["kind"] == "sequence"


def test_info_names_each_weights_form_and_bytes_a_group(capsys):
    code, out, _ = run_cli(capsys, "info", "--json", "--model", "synthetic:tiny", "--embedding", "q4")
    forms = json.loads(out)["model_forms"]
    assert code == 0 and forms["qkv"] == "int4 g64, 4 bytes a group (fp16 scale + fp16 offset)"
    assert forms["embedding"] == "int4 g64, 2.5 bytes a group (fp16 scale + 4-bit zero)"
    assert forms["lm_head"] == "int8 g32, 4 bytes a group (fp16 scale + offset)"
    rng = np.random.default_rng(0)   # a Q8_0 table's scales alone, a Q6_K one's in float32 per 16
    assert describe_weight(Q8Matrix.random(2, 64, 32, rng, symmetric=True)) == "int8 g32, 2 bytes a group (fp16 scale)"
    assert describe_weight(Q8Matrix.random(2, 64, 16, rng, f32=True, symmetric=True)) == ("int8 g16, 4 bytes a group "
                                                                                         "(float32 scale)")


def test_info_as_a_module_prints_the_choice():
    out = subprocess.run([sys.executable, "-m", "perfx", "info"], capture_output=True, text=True, check=True).stdout
    assert "perfx uses" in out and "limits in force" in out and "decode step: one " in out


def test_unknown_device_is_one_clear_line(capsys, monkeypatch):
    monkeypatch.setenv("PERFX_DEVICE", "no-such-device")
    code, _, err = run_cli(capsys, "info")
    assert code == 2 and err.startswith("perfx: error: PERFX_DEVICE='no-such-device' matches no OpenCL device")


def test_selftest_quick_passes_on_this_device(capsys, device, own_cache):
    code, out, _ = run_cli(capsys, "selftest", "--quick", "--json")
    data = json.loads(out)
    # Every family that can run here (the fp16 GEMM needs cl_khr_fp16).
    runnable = [s for s in SPECS.values() if s.params.candidates(s.test_shapes[0], device.caps)]
    assert code == 0 and data["failed"] == 0 and data["passed"] >= len(runnable) >= len(SPECS) - 1


def test_selftest_exits_1_when_a_kernel_is_broken(capsys, monkeypatch, own_cache):
    good = SPECS["rmsnorm"]

    def broken_case(device, shape, rng):
        case = good.make_case(device, shape, rng)
        run = case.run

        def wrong(params):  # as if the kernel dropped its last element
            outputs = run(params)
            return {k: np.concatenate([v.ravel()[:-1], [0.0]]).reshape(v.shape) * 1.01 for k, v in outputs.items()}

        return dataclasses.replace(case, run=wrong)

    monkeypatch.setenv(selftest.PROCESSES_ENV, "1")   # the patched specs are this process's
    monkeypatch.setattr(selftest, "select_specs",
                        lambda names: {"rmsnorm": dataclasses.replace(good, make_case=broken_case)})
    code, out, _ = run_cli(capsys, "selftest", "--quick")
    assert code == 1
    assert "FAIL" in out and "rmsnorm" in out and "0 passed, 1 failed" in out


def test_selftest_reports_sets_the_driver_refuses_apart_from_failures(capsys, monkeypatch, own_cache):
    """A set whose built kernel the driver's limits exclude (NVIDIA's: 256 work-items where its registers run
    out) is refused, not failed: the tuner never chooses it, so the exit status stays 0, and the count says so."""
    good = SPECS["rmsnorm"]

    def refusing_case(device, shape, rng):
        def refuse(params):
            raise KernelLimitError("kernels/rmsnorm.cl rmsnorm (-DWGS=128) requires work-groups of 512, but this "
                                   "driver runs it in groups of at most 256 (registers or local memory it needs)")
        return dataclasses.replace(good.make_case(device, shape, rng), run=refuse)

    monkeypatch.setenv(selftest.PROCESSES_ENV, "1")   # the patched specs are this process's
    monkeypatch.setattr(selftest, "select_specs",
                        lambda names: {"rmsnorm": dataclasses.replace(good, make_case=refusing_case)})
    code, out, _ = run_cli(capsys, "selftest", "--quick", "--json")
    data = json.loads(out)
    assert code == 0 and (data["passed"], data["failed"], data["refused"]) == (0, 0, 1)
    assert "requires work-groups of 512" in data["checks"][0]["refused"]
    code, out, _ = run_cli(capsys, "selftest", "--quick")
    assert code == 0 and "0 passed, 0 failed, 1 refused by the driver's limits" in out


def test_an_interrupted_selftest_reports_the_checks_done(capsys, monkeypatch, own_cache):
    """Ctrl-C (or a timeout's SIGINT) part way: the checks done so far are printed, the status is 130."""
    good = SPECS["rmsnorm"]

    def interrupting_case(device, shape, rng):
        def interrupt(params):
            raise KeyboardInterrupt
        return dataclasses.replace(good.make_case(device, shape, rng), run=interrupt)

    specs = {"swiglu": SPECS["swiglu"], "rmsnorm": dataclasses.replace(good, make_case=interrupting_case)}
    monkeypatch.setenv(selftest.PROCESSES_ENV, "1")   # the patched specs are this process's
    monkeypatch.setattr(selftest, "select_specs", lambda names: specs)
    code, out, err = run_cli(capsys, "selftest", "--quick", "--json")
    data = json.loads(out)
    assert code == 130 and data["interrupted"] and data["passed"] == 1 and data["checks"][0]["kernel"] == "swiglu"
    assert "interrupted after 1 checks" in err
    code, out, err = run_cli(capsys, "selftest", "--quick", "--json")   # the same command resumes past swiglu
    assert code == 130 and "resuming: 1 checks done before" in err and json.loads(out)["resumed"] == 1


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`perfx info | head -1`: the reader goes away, perfx ends with status 1 and no traceback."""
    process = subprocess.Popen([sys.executable, "-m", "perfx", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               cwd=tmp_path)
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait() == 1 and "Traceback" not in err and "BrokenPipeError" not in err, err


def test_selftest_unknown_family(capsys):
    code, _, err = run_cli(capsys, "selftest", "--kernels", "nope")
    assert code == 2 and "unknown kernel family 'nope'" in err


@pytest.mark.slow
def test_generate_answers_the_spider_question_and_continues_paris(capsys):
    code, out, err = run_cli(capsys, "generate", "--temperature", "0", "How many legs does a spider have?")
    assert code == 0 and ("eight" in out.lower() or "8" in out)
    assert "tok/s" in err and "tok/s" not in out  # stats to stderr only
    code, out, _ = run_cli(capsys, "generate", "--raw", "--temperature", "0", "--max-tokens", "3", "--json",
                           "The capital of France is")
    data = json.loads(out)
    assert code == 0 and data["text"].startswith(" Paris") and len(data["ids"]) == 3
    assert data["stats"]["decode_tok_s"] > 0 and data["stats"]["ttft_s"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "--temperature must be ≥ 0"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--model", "/no/such/model.gguf"], "Model not found: /no/such/model.gguf"),
])
def test_generate_bad_flags_are_one_clear_line(capsys, flags, message):
    code, out, err = run_cli(capsys, "generate", "hi", *flags)
    assert code == 2 and message in err and out == ""


def test_quantize_without_autoawq_says_how_to_install(capsys, tmp_path, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_awq(name, *args, **kwargs):
        if name == "awq" or name.startswith("awq."):
            raise ImportError("No module named 'awq'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_awq)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    code, _, err = run_cli(capsys, "quantize", str(tmp_path / "src"), str(tmp_path / "dst"))
    assert code == 2 and 'pip install -e ".[quantize]"' in err and "--quantize q4" in err
    code, _, err = run_cli(capsys, "quantize", str(tmp_path), str(tmp_path / "dst"))
    assert code == 2 and "not a Hugging Face model directory" in err
