"""Hardening of the files and paths a point reads (classes: tracebacks at input boundaries,
unbounded work, messages that name the wrong thing, paths and trust). Each table is a class: a case
is refused by the plan in one line naming the key and what is allowed, in under 5 s, writing nothing;
the class's fix is one place (harness.run.inputs.input_boundary, harness.config.paths, the prompt
reader's bounds), so a new member of the class is answered the same way."""
from __future__ import annotations

import json
import os
import random
import string
import time

import pytest

from harness.config.validate import ConfigError
from harness.run import inputs
from harness.run.plan import hydra_order
from tests.conftest import planned_point
from tests.gguf_files import byte_level_vocab, random_weights, write_gguf
from tests.hardening_helpers import TINY, refusal

SECONDS = 5.0


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", random_weights(len(byte_level_vocab()[0])))


def refused_quickly(*overrides: str) -> str:
    began = time.monotonic()
    message = refusal(*overrides)
    assert time.monotonic() - began < SECONDS, overrides
    assert len(message) <= 1000, message[:200]
    return message


# --- Tracebacks at input boundaries: whatever a reader raises is one line on its key ---------------


def deep_json(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    return f"prompt={path}"


def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return str(path)


BOUNDARY = {  # name -> (overrides given tmp_path, the key, what the line says)
    "a prompt JSON nested 200,000 deep": (lambda tmp: [deep_json(tmp)], "prompt", "deeper than Python reads"),
    "a 5,000-character checkpoint path": (lambda tmp: [f"model.checkpoint=/tmp/{'a' * 5000}.gguf"], "model.checkpoint",
                                          "File name too long"),
    "a 5,000-character pkg: file": (lambda tmp: [f"model.checkpoint=pkg:pytest/{'a' * 5000}.gguf"], "model.checkpoint",
                                     "File name too long"),
    "a 5,000-character prompt path": (lambda tmp: [f"prompt=/tmp/{'a' * 5000}.txt"], "prompt", "File name too long"),
    "a quoted ~nosuchuser checkpoint": (lambda tmp: ["model.checkpoint='~nosuchuser/x.gguf'"], "model.checkpoint",
                                        "names no user of this machine"),
    "a quoted ~nosuchuser prompt": (lambda tmp: ["prompt='~nosuchuser/x.txt'"], "prompt", "names no user"),
    "strategy=null": (lambda tmp: ["strategy=null"], "strategy", "takes one of its options by name"),
}


@pytest.mark.parametrize("case", list(BOUNDARY))
def test_an_input_boundary_answers_in_one_line_whatever_is_raised(tmp_path, case):
    overrides, key, says = BOUNDARY[case]
    message = refused_quickly(*overrides(tmp_path))
    assert message.startswith(f"{key}:") and says in message, message


@pytest.mark.parametrize("raised", [KeyError("tensor"), TypeError("unhashable"), IndexError("list index"),
                                    AttributeError("no attribute x"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"),
                                    RecursionError(), MemoryError(), Exception("a library's own")])
def test_any_exception_of_a_checkpoint_reader_is_one_line(monkeypatch, gguf_file, raised):
    """The class, not its cases: a reader that raises anything at all (a bug of a library on a file it was
    not written for) is answered on the key, naming the file."""
    def broken(location):
        raise raised

    monkeypatch.setattr(inputs, "read_checkpoint", broken)
    message = refused_quickly(f"model.checkpoint={gguf_file}")
    assert message.startswith("model.checkpoint:") and str(gguf_file) in message and type(raised).__name__ in message \
        or "nests deeper" in message


def test_a_library_that_registers_no_constants_is_unavailable_not_a_traceback(monkeypatch, tmp_path):
    from harness.kernels import extension

    monkeypatch.setattr(extension, "build_and_load", lambda cxx: tmp_path)  # loads nothing of this harness's
    monkeypatch.setattr(extension, "NAMESPACE", "no_such_kernels")
    monkeypatch.setattr(extension.shutil, "which", lambda name: "/bin/true")
    reason = extension.Extension().unavailable()
    assert reason is not None and "registers no no_such_kernels.constants" in reason and "\n" not in reason


# --- Unbounded work: every input's cost bounded before anything is measured ----------------------------


def test_a_one_line_prompt_without_whitespace_is_read_only_as_far_as_the_point_needs(gguf_file, tmp_path):
    path = tmp_path / "one-line.txt"
    letters = random.Random(0).choices(string.ascii_letters + string.digits + ".,;", k=5 * 2**20)
    path.write_text("".join(letters))  # 5 MB, no space, no line break: was tokenized whole (22.9 s)
    began = time.monotonic()
    point = planned_point("model=tiny", f"model.checkpoint={gguf_file}", f"prompt={path}", "ctx=16", "decode_tokens=4")
    assert time.monotonic() - began < SECONDS and point.prompt_hash


def test_the_first_ids_of_a_cut_prompt_are_the_whole_texts(gguf_file, tmp_path):
    from harness.measure.prompts import read_tokens
    from harness.model.gguf_tokenizer import gguf_tokenizer

    path = tmp_path / "short-line.txt"
    path.write_text("".join(random.Random(1).choices(string.ascii_lowercase + ".,", k=20_000)))
    whole = gguf_tokenizer(gguf_file).encode(path.read_text()).ids
    assert read_tokens(path, gguf_file, limit=100).tolist() == whole[:100]


@pytest.fixture
def eight_gib(monkeypatch):
    monkeypatch.setattr(inputs, "available_bytes", lambda device: 8 * 2**30)


@pytest.mark.parametrize("overrides,key", [
    (["accuracy.tokens=100000", "accuracy.batch=4096"], "accuracy.tokens"),  # the reference's logits: 51 GB
    (["accuracy.tokens=4096", "accuracy.steps=64", "accuracy.batch=64", "ctx=100000"], "accuracy.batch"),  # the chunk's cache
])
def test_an_accuracy_pass_memory_cannot_hold_is_refused_by_the_plan(eight_gib, overrides, key):
    message = refused_quickly("model=llama3_8b", "model.n_layers=1", "strategy=quantized", "dtype=float32",
                              "memory_limit_bytes=100000000000", *overrides)
    assert message.startswith(f"{key}:") and "GiB of memory is free" in message, message


@pytest.mark.parametrize("steps,tokens", [(20000, 8), (65, 64), (64, 1)])
def test_accuracy_steps_beyond_the_tokens_scored_are_refused(steps, tokens):
    message = refused_quickly("model=tiny", "strategy=quantized", "ctx=8", "decode_tokens=2",
                              f"accuracy.steps={steps}", f"accuracy.tokens={tokens}")
    assert message == f"accuracy.steps: must be at most accuracy.tokens={tokens:,} (the tokens scored), got {steps:,}"


def test_accuracy_steps_equal_to_the_tokens_scored_run_as_asked():
    point = planned_point("model=tiny", "strategy=quantized", "ctx=8", "decode_tokens=2", "accuracy.steps=8",
                          "accuracy.tokens=8")
    assert (point.accuracy.steps, point.accuracy.tokens) == (8, 8)


# --- Messages name the right thing ---------------------------------------------------------------


def ragged(tmp_path):
    path = tmp_path / "ragged.json"
    path.write_text(json.dumps([[1, 2, 3], [4, 5]]))
    return f"prompt={path}"


def mixed(tmp_path):
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps([1, [2, 3]]))
    return f"prompt={path}"


def made(tmp_path, name: str, folder: bool = False, text: str = ""):
    """`model.checkpoint=` a folder or a file named `name` (holding `text`) in tmp_path."""
    path = tmp_path / name
    path.mkdir() if folder else path.write_text(text)
    return f"model.checkpoint={path}"


NAMES = {  # name -> (overrides given tmp_path, the key, what the line says, what it must not say)
    "strategy.residual of 2^40": (lambda tmp: ["strategy=quantized", f"strategy.residual={2**40}"],
                                  "strategy.residual", "choose a smaller strategy.residual", "model, batch"),
    "strategy.block_size of 2^40": (lambda tmp: ["strategy=paged", f"strategy.block_size={2**40}"],
                                    "strategy.block_size", "smaller strategy.block_size", "model, batch"),
    "strategy.block_size of 2^62": (lambda tmp: ["strategy=paged", f"strategy.block_size={2**62}"],
                                    "strategy.block_size", "beyond a 64-bit integer", "batch"),
    "pkg:os": (lambda tmp: ["model.checkpoint=pkg:os/x.gguf"], "model.checkpoint", "standard library", "pip install"),
    "/dev/null as a checkpoint": (lambda tmp: ["model.checkpoint=/dev/null"], "model.checkpoint", "character device",
                                  "folder,"),
    "/dev/null as a prompt": (lambda tmp: ["prompt=/dev/null"], "prompt", "character device", "a folder,"),
    "a FIFO as a prompt": (lambda tmp: [f"prompt={fifo(tmp)}"], "prompt", "FIFO", "a folder,"),
    "a FIFO as a checkpoint": (lambda tmp: [f"model.checkpoint={fifo(tmp)}"], "model.checkpoint", "FIFO", "a folder,"),
    "ragged JSON rows": (lambda tmp: [ragged(tmp)], "prompt", "rows of 2 to 3 ids", "not JSON"),
    "JSON of ids and rows": (lambda tmp: [mixed(tmp)], "prompt", "must hold integer token ids", "not JSON"),
    "an empty prompt": (lambda tmp: ["prompt="], "prompt", "is empty: name a file", "a folder"),
    "an empty checkpoint": (lambda tmp: ["model.checkpoint= "], "model.checkpoint", "GGUF file", "name a folder"),
    "results_dir=/dev/null": (lambda tmp: ["results_dir=/dev/null"], "results_dir", "character device", "a file"),
    "a 100 KB model.name": (lambda tmp: [f"model.name={'x' * 100_000}/"], "model.name", "...", "x" * 2000),
    # A checkpoint named like what it is not: each was "has no config.json" or "a file, not a .gguf one" before.
    "a folder named x.gguf": (lambda tmp: [made(tmp, "x.gguf", folder=True)], "model.checkpoint",
                              "is a folder, not a GGUF file, and holds no config.json; allowed: a .gguf file, or a "
                              "Hugging Face format folder (config.json and *.safetensors)", "has no config.json"),
    "a folder named x.safetensors": (lambda tmp: [made(tmp, "x.safetensors", folder=True)], "model.checkpoint",
                                     "is a folder without config.json; allowed: a .gguf file", "has no"),
    "a config.json file": (lambda tmp: [made(tmp, "config.json", text="{}")], "model.checkpoint",
                           "is one file of a Hugging Face format folder: name the folder", "not a .gguf one"),
    "a .safetensors file": (lambda tmp: [made(tmp, "model.safetensors", text="x")], "model.checkpoint",
                            "is one file of a Hugging Face format folder: name the folder", "not a .gguf one"),
    "an empty x.gguf": (lambda tmp: [made(tmp, "x.gguf")], "model.checkpoint", "cannot be read as GGUF: the file is empty",
                        "folder"),
}


@pytest.mark.parametrize("case", list(NAMES))
def test_a_message_names_the_key_and_what_it_is(tmp_path, case):
    overrides, key, says, not_said = NAMES[case]
    message = refused_quickly(*overrides(tmp_path))
    assert message.startswith(f"{key}:") and says in message and not_said not in message, message


def test_a_gguf_type_error_says_the_type_not_a_range(tmp_path):
    path = write_gguf(tmp_path / "typed.gguf", random_weights(len(byte_level_vocab()[0])),
                      metadata={"block_count": "2", "attention.head_count": 2.0})
    message = refused_quickly(f"model.checkpoint={path}")
    assert "llama.block_count must be an integer" in message and "got '2' (a string)" in message, message
    assert "JSON" not in message, message  # a GGUF field's message names no format the file is not in


def test_a_flag_after_an_override_is_taken_as_hydra_takes_flags_first():
    argv = ["model=tiny", "ctx=16", "-m", "batch=1,2"]
    assert hydra_order(argv) == ["-m", "model=tiny", "ctx=16", "batch=1,2"]
    assert len(planned_count := [p for p in __import__("harness.run.plan", fromlist=["plan"]).plan(
        [*TINY, *argv[:2], "-m", "batch=1,2"], cuda_available=lambda: False).planned]) == 2, planned_count


@pytest.mark.slow  # through the CLI: Hydra's own parser after the plan
def test_a_flag_after_an_override_runs_from_the_command_line(tmp_path):
    from tests.hardening_helpers import FAST, cli, seeded

    results = seeded(tmp_path / "results")
    done = cli(*FAST, "ctx=8", "-m", "batch=1,2", f"results_dir={results}")
    assert done.returncode == 0 and "usage" not in done.stderr.lower(), done.stderr[-2000:]


# --- Paths and trust -----------------------------------------------------------------------------


@pytest.mark.parametrize("location", ["pkg:pytest/../../../../etc/passwd", "pkg:pytest/../_pytest/python.py",
                                      "pkg:pytest//etc/passwd"])
def test_a_pkg_path_stays_inside_its_package(location):
    message = refused_quickly(f"model.checkpoint={location}")
    assert message.startswith("model.checkpoint:") and "leads outside package pytest" in message, message


def test_a_pkg_path_through_a_link_out_of_the_package_is_refused(tmp_path, monkeypatch):
    package = tmp_path / "site" / "leaky_models"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (tmp_path / "secret.gguf").write_bytes(b"GGUF")
    (package / "model.gguf").symlink_to(tmp_path / "secret.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    message = refused_quickly("model.checkpoint=pkg:leaky_models/model.gguf")
    assert "leads outside package leaky_models" in message, message
