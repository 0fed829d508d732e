"""The embedded default model (jaxinfra/default_model), trained by scripts/build_default_model.py: a
real Hugging Face folder (transformers gives the same tokens and logits), under 30 MB, far below the
unigram perplexity, the README's samples reproduce, and `jaxinfra serve` with no --model answers the
official openai client."""

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfra.loading import DEFAULT_MODEL, DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME, load_model, load_tokenizer

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

README = Path(__file__).resolve().parent.parent / "README.md"
CPU_CONFIG = README.parent / "configs" / "serve" / "cpu.yaml"
TEXT = "And it came to pass, when the king heard the words of the prophet, that he rent his clothes."


def test_default_is_the_embedded_folder_in_hf_layout():
    assert Path(DEFAULT_MODEL) == DEFAULT_MODEL_DIR
    names = {p.name for p in DEFAULT_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir()) < 30e6
    assert "assistant" in json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["bos_token_id"] == 0


def test_transformers_loads_it_with_the_same_tokens_and_logits():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    ids = load_tokenizer(DEFAULT_MODEL).encode(TEXT)
    assert ids == hf_tok(TEXT)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(load_model(DEFAULT_MODEL, dtype="float32")(jnp.asarray([ids])))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_heldout_perplexity_is_far_below_unigram():
    """Recomputed, not read back: the model's perplexity on chapters it never saw (every 33rd chapter
    was held out; these are the ones in the committed excerpt) against a unigram model of the rest."""
    from jaxinfra.data import load_documents
    from jaxinfra.data.pipeline import document_tokens, unigram_entropy

    chapters = load_documents([Path(__file__).parent / "fixtures" / "kjv_excerpt.txt"])  # every 8th chapter
    tok, model = load_tokenizer(DEFAULT_MODEL), load_model(DEFAULT_MODEL)
    docs = [document_tokens(tok, c) for c in chapters]
    held = [d for j, d in enumerate(docs) if (8 * j) % 33 == 0]  # the held-out chapters among them
    assert len(held) >= 4
    nll, count = 0.0, 0
    for ids in held:
        for start in range(0, len(ids) - 1, 255):  # windows of the model's 256-token context
            window = jnp.asarray([ids[start : start + 256]])
            logp = jax.nn.log_softmax(model(window)[0, :-1], axis=-1)
            targets = window[0, 1:]
            nll -= float(jnp.take_along_axis(logp, targets[:, None], axis=-1).sum())
            count += int(targets.shape[0])
    perplexity = float(np.exp(nll / count))
    unigram = float(np.exp(unigram_entropy(d for j, d in enumerate(docs) if (8 * j) % 33)))
    recorded = json.loads((DEFAULT_MODEL_DIR / "metrics.json").read_text())["heldout_perplexity"]
    assert perplexity < unigram / 4, (perplexity, unigram)
    assert abs(np.log(perplexity / recorded)) < 0.5, (perplexity, recorded)  # the same ballpark as the build's


def _readme_samples() -> list[tuple[str, str]]:
    block = README.read_text().split("<!-- samples -->")[1]
    return re.findall(r"^- \*\*(.+?)\*\*(.*)$", block, re.M)


def test_readme_samples_are_what_the_model_generates():
    from serve import LLM, SamplingParams

    samples = _readme_samples()
    assert len(samples) == 3
    llm = LLM()
    outs = llm.generate([p for p, _ in samples], SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False)
    for (prompt, shown), out in zip(samples, outs):
        assert out.outputs[0].text.replace("\n", " / ") == shown, prompt


def test_serve_model_comes_from_flag_then_yaml_then_default(tmp_path):
    from serve.http.cli_args import build_parser, engine_args_from

    def model_of(*argv):
        return engine_args_from(build_parser().parse_args(list(argv))).model

    assert model_of() == model_of("--config", str(CPU_CONFIG)) == DEFAULT_MODEL
    (tmp_path / "tiny.yaml").write_text(CPU_CONFIG.read_text() + "model: tiny-llama\n")
    assert model_of("--config", str(tmp_path / "tiny.yaml")) == "tiny-llama"
    assert model_of("--config", str(tmp_path / "tiny.yaml"), "--model", "tiny-qwen3") == "tiny-qwen3"


def test_serve_with_no_model_answers_the_openai_client():
    from openai import OpenAI

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = ["serve", "--config", str(CPU_CONFIG), "--port", str(port), "--no-warmup"]  # `make run`, no warmup
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxinfra", *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        lines = iter(proc.stdout.readline, "")
        banner = next((line for line in lines if line.startswith("serving")), "")
        assert banner.startswith(f"serving {DEFAULT_MODEL_NAME} on") and "curl" in next(lines), banner
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.time() + 120
        while True:
            try:
                completion = client.completions.create(
                    model=DEFAULT_MODEL_NAME, prompt="And God said", max_tokens=12, temperature=0
                )
                break
            except Exception:  # the server may still be binding its port
                if time.time() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.5)
        assert completion.choices[0].text.strip() and completion.usage.completion_tokens > 0
        chat = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, max_tokens=8, messages=[{"role": "user", "content": "Who made the heaven?"}]
        )
        assert chat.choices[0].message.content is not None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
