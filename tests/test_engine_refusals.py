"""An engine that cannot run a model says why in its own words, as a skipped row of one line (no colour
codes), and the analytic CLI refuses an engine KV layout the engine refuses, in one line with exit 2
(strategies.engines.engine: PeerStrategy.refused, EngineSession.refused_at_first, check_layout).

Table cases, each with its neighbours: ONNX Runtime GenAI on head widths its attention node refuses (8,
12, 24) beside one it runs (16), on a GGUF without a tokenizer or with one transformers cannot read (its
builder reads a Hugging Face folder with the tokenizer); llama.cpp on the same files (it logs why it
refuses a model; the row keeps that line, not only "failed to load model"; it reads an RWKV vocabulary,
not one it does not know) and on block KV types at head widths their blocks do not divide; OpenVINO,
which runs them all. device=cpu throughout; each engine's cases skip, naming the command, where its
wheel is not installed.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

from harness.analysis.cli import main as analytic_main
from harness.measure.group import GroupRequest, measure_group
from strategies.engines.artifacts.llamacpp_library import KEPT_LINES, Library
from strategies.engines.engine import MOST_WORDS, WHEEL, one_line
from tests.conftest import QUICK_CALIBRATION, planned_point, run_cli
from tests.gguf_files import CONFIG, Q, byte_level_vocab, random_weights, write_gguf

WHEELS = {"ortgenai_fp32": "onnxruntime_genai", "llamacpp_f16": "llama_cpp_py_sync", "llamacpp_q8_0": "llama_cpp_py_sync",
         "llamacpp_q4_0": "llama_cpp_py_sync", "openvino_f32": "openvino"}
# file name -> (heads, KV heads, width, what write_gguf is told about the tokenizer)
FILES = {"hd8": (8, 2, 64, {}), "hd12": (4, 2, 48, {}), "hd24": (2, 1, 48, {}), "hd16": (4, 2, 64, {}),
         "hd32": (2, 1, 64, {}), "no-tokenizer": (2, 1, 64, {"tokenizer": None}),
         "rwkv-tokenizer": (2, 1, 64, {"tokenizer_metadata": {"model": "rwkv"}}),
         "unknown-tokenizer": (2, 1, 64, {"tokenizer_metadata": {"model": "nonesuch"}})}


@pytest.fixture(scope="module")
def engine_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        folder = tmp_path_factory.mktemp("engine-cache")
        patch.setenv("HARNESS_KERNEL_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("refusals")
    files = {}
    for name, (heads, kv_heads, width, tokenizer) in FILES.items():
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(CONFIG, "num_attention_heads", heads)
            patch.setitem(CONFIG, "num_key_value_heads", kv_heads)
            patch.setitem(CONFIG, "hidden_size", width)
            files[name] = write_gguf(folder / f"{name}.gguf", random_weights(len(byte_level_vocab()[0])), kind=Q.F32,
                                     **tokenizer)
    return files


def point_of(path, strategy: str, *more: str):
    return dataclasses.replace(planned_point("model=tiny", f"model.checkpoint={path}", f"strategy={strategy}", "ctx=8",
                                             "decode_tokens=2", "accuracy.tokens=8", "accuracy.steps=4", *more),
                               interleave="shape")


def engine_row(model_files, name: str, strategy: str) -> dict:
    if importlib.util.find_spec(WHEELS[strategy]) is None:
        pytest.skip(f"{WHEELS[strategy]} is not installed: pip install -e '.[peers]'")
    path = model_files[name]
    return measure_group(GroupRequest("refusal", (point_of(path, "contiguous"), point_of(path, strategy))))[1]


# (file, member, status, what the reason holds: the engine's own words)
CASES = [
    ("hd8", "ortgenai_fp32", "skipped", "head_size shall be a multiple of 16"),
    pytest.param("hd12", "ortgenai_fp32", "skipped", "head_size must be a multiple of 8", marks=pytest.mark.slow),
    pytest.param("hd24", "ortgenai_fp32", "skipped", "head_size shall be a multiple of 16", marks=pytest.mark.slow),
    pytest.param("hd16", "ortgenai_fp32", "ok", "", marks=pytest.mark.slow),
    ("no-tokenizer", "ortgenai_fp32", "skipped", "Cannot build a tokenizer from a GGUF file stating tokenizer None"),
    ("rwkv-tokenizer", "ortgenai_fp32", "skipped", "stating tokenizer 'rwkv'"),
    ("no-tokenizer", "llamacpp_f16", "skipped", "key not found in model: tokenizer.ggml.model"),
    ("unknown-tokenizer", "ortgenai_fp32", "skipped", "stating tokenizer 'nonesuch'"),
    ("unknown-tokenizer", "llamacpp_f16", "skipped", "unknown tokenizer: 'nonesuch'"),
    ("rwkv-tokenizer", "llamacpp_f16", "ok", ""),  # llama.cpp has an RWKV vocabulary of its own
    ("hd16", "llamacpp_q8_0", "skipped", "does not divide n_embd_head_k=16"),
    ("hd24", "llamacpp_q4_0", "skipped", "does not divide n_embd_head_k=24"),
    ("hd8", "llamacpp_f16", "ok", ""),
    ("hd32", "llamacpp_q4_0", "ok", ""),
    # OpenVINO converts the weights without the tokenizer, and its attention node takes these widths
    ("no-tokenizer", "openvino_f32", "ok", ""),
    ("hd8", "openvino_f32", "ok", ""),
    pytest.param("hd12", "openvino_f32", "ok", "", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name, strategy, status, words", CASES)
def test_an_engine_that_cannot_run_a_model_is_a_skipped_row_in_its_own_words(model_files, engine_cache, name, strategy,
                                                                              status, words):
    row = engine_row(model_files, name, strategy)
    assert row["status"] == status, row["reason"]
    if status == "skipped":
        reason = row["reason"]
        assert words in reason and reason.startswith(("ONNX Runtime GenAI ", "llama.cpp ")), reason
        assert "\n" not in reason and "\x1b" not in reason, reason


def test_the_runner_says_an_engines_refusal_in_one_line_and_goes_on(model_files, engine_cache, tmp_path):
    """The whole command: exit 0, a skipped row, no colour codes and no engine log on the console."""
    if importlib.util.find_spec("onnxruntime_genai") is None:
        pytest.skip("onnxruntime_genai is not installed: pip install -e '.[peers]'")
    # matmul=aten: the calibration then leaves the C linear out, which in this module's fresh kernel cache
    # would first compile the extension (~18 s of this test's ~30 s), and the engine's refusal is what is tested
    done = run_cli("model=tiny", f"model.checkpoint={model_files['hd8']}", "strategy=ortgenai_fp32", "ctx=8",
                   "decode_tokens=2", "accuracy.tokens=8", "accuracy.steps=4", "isolate=false", QUICK_CALIBRATION,
                   "matmul=aten", f"results_dir={tmp_path / 'results'}")
    assert done.returncode == 0, done.stderr[-2000:]
    console = done.stdout + done.stderr
    assert "\x1b" not in console and "GroupQueryAttention" in console
    assert [line for line in console.splitlines() if "GroupQueryAttention" in line] == \
        [line for line in console.splitlines() if "ortgenai_fp32" in line and "skipped" in line]


# (overrides, exit code, what the one line on stderr holds): the analytic model's figures only where the engine stores that layout
ANALYTIC = [
    (("model=tiny", "strategy=llamacpp_q8_0"), 2, "strategy.kv_type: q8_0 stores K/V in blocks of 32 elements, and "
     "head_dim 16 is not a multiple of 32: llama.cpp refuses it; allowed at head_dim 16: f32, f16"),
    (("model=tiny", "strategy=llamacpp_q4_0"), 2, "strategy.kv_type: q4_0 stores K/V in blocks of 32 elements"),
    (("model=tiny", "model.head_dim=48", "strategy=llamacpp_q4_0"), 2, "head_dim 48 is not a multiple of 32"),
    (("model=tiny", "strategy=llamacpp_f16", "strategy.kv_type=q8_0"), 2, "head_dim 16 is not a multiple of 32"),
    (("model=tiny", "model.head_dim=64", "strategy=llamacpp_q8_0"), 0, ""),
    (("model=llama3_8b", "strategy=llamacpp_q4_0"), 0, ""),
    (("model=tiny", "strategy=llamacpp_q8_0", "strategy.kv_type=f16"), 0, ""),
    (("model=tiny", "strategy=openvino_u8"), 0, ""),
    (("model=tiny", "strategy=ortgenai_fp32"), 0, ""),
]


@pytest.mark.parametrize("overrides, code, line", ANALYTIC)
def test_the_analytic_cli_refuses_a_kv_layout_the_engine_refuses(capsys, overrides, code, line):
    assert analytic_main([*overrides, "hardware=h100_sxm", "format=json"]) == code
    out, err = capsys.readouterr()
    if code:
        assert err.startswith("strategy.kv_type: ") and line in err and err.count("\n") == 1 and out == "", err
    else:
        figures = json.loads(out)
        assert figures["kv_bytes_per_token"] > 0 and err == ""


def test_an_engines_words_make_one_line():
    """Colour codes dropped, lines joined once each, long messages cut (no wheel needed)."""
    said = "\x1b[1;31m2026-12-05 [E:onnxruntime:, sequential_executor.cc:572] Non-zero status\x1b[m\n\n  then this\nthen this\n"
    assert one_line(said) == "2026-12-05 [E:onnxruntime:, sequential_executor.cc:572] Non-zero status / then this"
    assert one_line(ValueError("one")) == "one"
    long = one_line("x" * 1000)
    assert len(long) == MOST_WORDS and long.endswith("...")


def test_llamacpp_gives_the_lines_it_logged_at_error_since_the_call():
    """What a refused model or context leaves: the ERROR messages of that call (a continued one joined to
    its start), not the INFO lines before it nor its closing line alone; its last line where it logged no error."""
    library = Library(lib=None, ffi=None, version="", system_info="", build=WHEEL, build_flags="")
    library.keep(4, "an earlier call's error\n")
    mark = library.logged
    library.keep(2, "llama_model_loader: - kv 10: llama.vocab_size u32 = 320\n")
    library.keep(4, "llama_model_load: error loading model: error loading model vocabulary: ")
    library.keep(5, "key not found in model: tokenizer.ggml.model\n")
    library.keep(4, "llama_model_load_from_file_impl: failed to load model\n")
    assert library.said_since(mark).splitlines() == [
        "llama_model_load: error loading model: error loading model vocabulary: key not found in model: tokenizer.ggml.model",
        "llama_model_load_from_file_impl: failed to load model"]
    quiet = library.logged
    library.keep(2, "llama_context: n_ctx = 512\n")
    assert library.said_since(quiet) == "llama_context: n_ctx = 512\n"
    for line in range(2 * KEPT_LINES):
        library.keep(2, f"line {line}\n")
    assert len(library.log) == KEPT_LINES and library.said_since(library.logged - 1) == f"line {2 * KEPT_LINES - 1}\n"
