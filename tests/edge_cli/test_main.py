"""The `edge-runtime` CLI as a user runs it: real processes, the embedded model."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.child_process import sigint_default
from tests.gguf_fixtures import write_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args, timeout=300, input=None):
    return subprocess.run([sys.executable, "-m", "edge_cli", *args], capture_output=True, text=True,
                          timeout=timeout, input=input, cwd=ROOT)


def test_generate_json_has_the_documented_fields():
    p = run("generate", "--json", "--max-tokens", "12", "What is 2+2?")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    for key in ("text", "token_ids", "finish_reason", "backend", "prompt_tokens", "completion_tokens",
                "ttft_ms", "decode_tok_per_s"):
        assert key in out
    assert out["backend"] == "native" and out["finish_reason"] in ("stop", "length")
    assert out["completion_tokens"] == len(out["token_ids"]) > 0 and "4" in out["text"]
    import devices

    assert out["device_profile"] == devices.choose(devices.detect()).profile  # --backend auto took the profile


def test_generate_draft_flag_same_answer_with_draft_stats():
    """--draft on the CLI: the default (auto) drafts with prompt lookup where the last two tokens match and
    the shipped heads elsewhere (mtp-ngram), mtp uses the heads alone, and the answer is the one plain
    decoding gives; MTP on llama.cpp is refused with a clear error."""
    prompt = "Repeat exactly: red, green, blue, red, green, blue, red, green, blue."
    outs = {}
    for draft in ("none", "auto", "mtp"):
        p = run("generate", "--json", "--max-tokens", "32", "--draft", draft, prompt)
        assert p.returncode == 0, p.stderr
        outs[draft] = json.loads(p.stdout)
    assert outs["none"]["draft"] == {"method": "none"}
    assert outs["auto"]["draft"]["method"] == "mtp-attn-ngram" and outs["mtp"]["draft"]["method"] == "mtp"
    assert outs["auto"]["draft"]["verify_steps"] > 0 and outs["auto"]["draft"]["accepted"] > 0
    assert outs["auto"]["token_ids"] == outs["none"]["token_ids"] == outs["mtp"]["token_ids"]
    p = run("generate", "--backend", "llama.cpp", "--draft", "mtp", "--max-tokens", "4", "Hi")
    assert p.returncode == 2 and "MTP drafting needs the native backend" in p.stderr


def test_generate_streams_text_on_llama_cpp_raw():
    p = run("generate", "--backend", "llama.cpp", "--raw", "--max-tokens", "8", "The capital of France is")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout


def test_perplexity_json(tmp_path, prose):
    f = tmp_path / "text.txt"
    f.write_text(prose[:6000])
    p = run("perplexity", "--backend", "llama.cpp", "--ctx", "256", "--json", str(f))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["backend"] == "llama.cpp" and out["tokens"] > 0 and 1 < out["ppl"] < 100
    assert out["cpu_model"] and out["threads"] >= 1 and "commit" in out and out["arith"] is None  # where it ran


def bad(args, pattern):
    p = run(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = [line for line in p.stderr.splitlines() if line.startswith("edge-runtime: error:")]
    assert len(lines) == 1 and pattern in lines[0], p.stderr


def test_missing_model_file():
    bad(["generate", "--model", "/nonexistent/model.gguf", "hi"], "model file not found")


def test_not_a_gguf(tmp_path):
    f = tmp_path / "notes.gguf"
    f.write_text("just some text, not a model")
    for backend in ("native", "llama.cpp"):
        bad(["generate", "--backend", backend, "--model", str(f), "hi"], "not a GGUF file")


def test_truncated_gguf(tmp_path, model_path):
    f = tmp_path / "cut.gguf"
    with open(model_path, "rb") as src:
        f.write_bytes(src.read(3_000_000))
    bad(["generate", "--model", str(f), "hi"], "truncated")


def test_unsupported_architecture(tmp_path):
    f = write_tiny_llama(tmp_path / "mamba.gguf", arch="mamba")
    bad(["generate", "--model", str(f), "hi"], "unsupported architecture 'mamba'")


def test_unsupported_tensor_type(tmp_path):
    import gguf

    f = write_tiny_llama(tmp_path / "q2k.gguf", weight_type=gguf.GGMLQuantizationType.Q2_K)
    bad(["generate", "--model", str(f), "hi"], "unsupported tensor type Q2_K")


def test_bad_kv_budget_and_prompt_over_budget():
    bad(["generate", "--kv-budget", "lots", "hi"], "--kv-budget 'lots'")
    bad(["generate", "--kv-budget", "1MiB", "word " * 60], "KV budget (1.0 MiB, fp16) holds 32 tokens")


def test_generate_with_int8_kv_and_a_budget():
    p = run("generate", "--kv-dtype", "int8", "--kv-budget", "64MiB", "--json", "--max-tokens", "8", "--raw",
            "The capital of France is")
    assert p.returncode == 0, p.stderr
    assert "Paris" in json.loads(p.stdout)["text"]


def test_prompt_longer_than_context():
    bad(["generate", "--ctx", "32", "word " * 60], "context window is 32 tokens")


@pytest.mark.parametrize("flag, value, name", [("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"),
                                               ("--max-tokens", "0", "max_tokens"), ("--top-k", "-2", "top_k")])
def test_invalid_sampling_values(flag, value, name):
    bad(["generate", flag, value, "hi"], f"invalid {name}")


def test_chat_keeps_history_resets_and_survives_ctrl_c():
    proc = subprocess.Popen([sys.executable, "-m", "edge_cli", "chat", "--max-tokens", "400", "--temperature", "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, bufsize=1, preexec_fn=sigint_default)
    try:
        proc.stdin.write("Write a very long story about a dragon.\n")
        proc.stdin.flush()
        got = ""
        deadline = time.time() + 240
        while len(got) < 40 and time.time() < deadline:  # the answer is streaming
            got += os.read(proc.stdout.fileno(), 64).decode(errors="replace")
        proc.send_signal(signal.SIGINT)  # stops this answer only
        proc.stdin.write("What is my name?\n/reset\nWhat is my name?\n/quit\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    out = got + out
    assert proc.returncode == 0, err
    assert "[stopped]" in out and "[history cleared]" in out
    after_stop = out.split("[stopped]")[1].split("[history cleared]")
    assert after_stop[0].strip() and after_stop[1].strip()  # it went on answering, before and after /reset


def test_unavailable_device():
    if __import__("torch").cuda.is_available():
        pytest.skip("CUDA is present")
    bad(["generate", "--device", "cuda", "hi"], "device 'cuda' (profile laptop_cuda) is not available here: no CUDA GPU")


def test_arith_flag_applies_and_is_refused_where_it_does_not():
    """--arith exact and int8 both answer (different arithmetic, same command); on llama.cpp, with torch's
    int4 weights, or on a worker with an upstream engine the flag does not apply: exit 2, one line."""
    from kernels import cpu_gemv

    if not cpu_gemv.available():
        pytest.skip("C kernels unavailable here")
    outs = {}
    for arith in ("int8", "exact"):
        p = run("generate", "--json", "--arith", arith, "--max-tokens", "8", "--draft", "none", "What is 2+2?")
        assert p.returncode == 0, p.stderr
        outs[arith] = json.loads(p.stdout)["token_ids"]
    assert outs["int8"] and outs["exact"]
    for argv in (["generate", "--backend", "llama.cpp", "--arith", "int8", "hi"],
                 ["generate", "--quant", "int4", "--arith", "exact", "hi"],
                 ["worker", "--upstream", "http://127.0.0.1:9/v1", "--arith", "exact"]):
        p = run(*argv, timeout=120)
        assert p.returncode == 2, (argv, p.stderr)
        assert p.stderr.strip().splitlines()[-1].startswith("edge-runtime: error: --arith"), p.stderr


@pytest.mark.parametrize("argv, start", [
    (["generate", "--backend", "llama.cpp", "--kv-dtype", "int8", "hi"], "--kv-dtype applies to the native backend"),
    (["generate", "--backend", "llama.cpp", "--quant", "int4", "--kv-budget", "1GB", "hi"],
     "--quant, --kv-budget apply to the native backend"),
    (["generate", "--backend", "onnxruntime", "--compile", "hi"], "--compile applies to the native backend"),
    (["serve", "--backend", "llama.cpp", "--max-batch", "4"], "--max-batch applies to the native backend"),
    (["worker", "--compile"], "--compile does not apply to the worker"),
    (["worker", "--upstream", "http://127.0.0.1:9/v1", "--max-batch", "4"], "--max-batch applies to the worker's own"),
    (["worker", "--max-batched-tokens", "100"], "--max-batched-tokens 100 is below what one step needs"),
])
def test_a_flag_that_does_not_apply_is_refused_in_one_line(argv, start):
    """Native-only flags on llama.cpp / onnxruntime, --compile on the worker, engine flags beside --upstream,
    and a step budget the worker would have raised behind the user's back: exit 2 and one line that names
    the flag, before any model loads."""
    p = run(*argv, timeout=120)
    assert p.returncode == 2, (argv, p.stderr)
    assert p.stderr.strip().splitlines()[-1].startswith("edge-runtime: error: " + start), p.stderr


def test_a_missing_compiler_is_a_one_line_error_naming_the_fix(tmp_path):
    """No gcc on PATH and no cached build: the GGUF kernels cannot be built, and the command says so in one
    line with the fix, instead of running slowly without them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = dict(os.environ, PATH=str(bin_dir), EDGE_RUNTIME_CACHE=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-m", "edge_cli", "generate", "--max-tokens", "2", "Hi"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 2, p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("edge-runtime: error: the CPU kernels") and "install a C compiler" in line
    assert "--quant int4" in line
