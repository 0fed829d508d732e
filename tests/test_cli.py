"""The `jaxinfra` command, run as a user would."""

import subprocess
import sys

import pytest
import transformers

from jaxinfra.tokenizer import Tokenizer
from tests.hf_oracle import make_hf_model, save_hf_model

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out


def _run(*args):
    return subprocess.run([sys.executable, "-m", "jaxinfra", *args], capture_output=True, text=True, timeout=300)


def test_generate_on_hf_directory_prints_text(tmp_path):
    save_hf_model(make_hf_model("llama3_rope_scaling", vocab_size=Tokenizer.byte_level().vocab_size), tmp_path)
    Tokenizer.byte_level().save(tmp_path)
    r = _run(
        "generate",
        "--model",
        str(tmp_path),
        "--prompt",
        "Hello",
        "--prompt",
        "Bye",
        "--max-tokens",
        "6",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "1",
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("Hello") and any(line.startswith("Bye") for line in lines[1:])
    chat = _run("generate", "--model", str(tmp_path), "--prompt", "Hi", "--chat", "--max-tokens", "3")
    assert chat.returncode == 0, chat.stderr


def test_info_and_errors():
    r = _run("info", "--model", "llama-3.2-1b")
    assert r.returncode == 0 and "1,235,814,400" in r.stdout and "32,768" in r.stdout
    bad = _run("generate", "--model", "no-such-model", "--prompt", "x")
    assert bad.returncode == 2 and "neither a local directory nor a preset" in bad.stderr
    bad = _run("generate", "--prompt", "x", "--top-p", "2")
    assert bad.returncode == 2 and "top_p" in bad.stderr


def test_convert_writes_a_loadable_directory(tmp_path):
    r = _run("convert", "--model", "tiny-mistral", "--out", str(tmp_path), "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.sliding_window == 16 and str(model.dtype) == "torch.bfloat16"
