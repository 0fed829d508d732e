"""`jaxinfra serve` flags: one per EngineArgs field (generated), YAML < flags < key=value, errors that
name the flag, and the server on 2 CPU devices with tensor parallelism and an int8 KV cache."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from serve import EngineArgs
from serve.http.cli_args import build_parser, engine_args_from, flag
from serve.http.main import main
from tests.serve_helpers import ENGINE_DEFAULTS, GREEDY, engine, run

# A value other than the default for each of these fields (a field added later still gets its flag:
# see the first test).
NON_DEFAULT = dict(
    model="tiny-llama",
    tokenizer="tiny-qwen3",
    dtype="bfloat16",
    seed=7,
    block_size=32,
    max_model_len=512,
    max_num_seqs=3,
    max_num_batched_tokens=96,
    enable_prefix_caching=False,
    enable_chunked_prefill=False,
    gpu_memory_utilization=0.5,
    num_gpu_blocks_override=40,
    kv_cache_memory=1 << 20,
    kv_cache_dtype="fp8",
    quantization="int4",
    tensor_parallel_size=2,
    attn_impl="reference",
    async_scheduling=False,
    num_scheduler_steps=4,
    scheduling_policy="priority",
    compilation_cache_dir="",
    background_compile=False,
    compile_threads=3,
)


def argv_for(values: dict) -> list[str]:
    """Flags setting `values` (vLLM's spelling; bools as --x / --no-x)."""
    out: list[str] = []
    for k, v in values.items():
        out += [flag(k) if v else f"--no-{flag(k)[2:]}"] if isinstance(v, bool) else [flag(k), str(v)]
    return out


def parse(*argv: str) -> EngineArgs:
    return engine_args_from(build_parser().parse_intermixed_args(list(argv)))


def test_every_engine_argument_is_a_flag_with_vllms_name():
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    options = build_parser()._option_string_actions
    for name, f in fields.items():
        assert options[flag(name)].dest == name
        if f.type in (bool, "bool"):
            assert options[f"--no-{flag(name)[2:]}"].dest == name
    for name, value in NON_DEFAULT.items():
        f = fields[name]
        assert value != (f.default if f.default_factory is dataclasses.MISSING else f.default_factory()), name
    parsed = dataclasses.asdict(parse(*argv_for(NON_DEFAULT)))
    assert {k: parsed[k] for k in NON_DEFAULT} == NON_DEFAULT
    assert {"--tensor-parallel-size", "--kv-cache-dtype", "--gpu-memory-utilization", "--max-num-seqs"} <= set(options)
    assert {"--enable-prefix-caching", "--no-enable-prefix-caching", "--num-scheduler-steps", "-q"} <= set(options)
    assert parse() == EngineArgs()  # no flag given: the dataclass's defaults


def test_yaml_then_flags_then_key_value_overrides(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_num_seqs: 5\nblock_size: 32\nkv_cache_dtype: int8\nenable_prefix_caching: false\n")
    args = parse("--config", str(cfg), "--max-num-seqs", "6", "block_size=8", "--enable-prefix-caching")
    assert (args.max_num_seqs, args.block_size, args.kv_cache_dtype, args.enable_prefix_caching) == (6, 8, "int8", True)
    assert parse("--config", str(cfg), "max_num_seqs=9", "--max-num-seqs", "6").max_num_seqs == 9


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--kv-cache-dtype", "int4"], "argument --kv-cache-dtype must be one of auto, int8, fp8"),
        (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization must be in (0, 1]"),
        (["num_scheduler_steps=0"], "argument --num-scheduler-steps must be a positive int"),
        (["max_num_seq=3"], "unknown engine argument(s) ['max_num_seq']"),
        (["max_num_seqs"], "override 'max_num_seqs' is not key=value"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_flag(argv, message, capsys):
    assert main(["--no-warmup", *argv]) == 2  # refused before any engine starts
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--max-num-seq", "3"], "unrecognized arguments: --max-num-seq\n"),  # no abbreviations
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
    ],
)
def test_an_unknown_flag_is_an_error_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_serve_tensor_parallel_2_with_int8_kv_on_two_cpu_devices(tmp_path):
    """`jaxinfra serve --tensor-parallel-size 2 --kv-cache-dtype int8` on 2 virtual CPU devices answers
    with the greedy tokens of the one-device engine with the same int8 KV cache; with decode loops
    (`--num-scheduler-steps 4`) a stream of them comes one token a chunk (the loop's tap runs once,
    on the first device)."""
    prompt = [5, 17, 300, 42, 7, 99]
    expected = run(engine(kv_cache_dtype="int8"), {0: [("r", prompt, GREEDY)]})["r"].outputs[0].token_ids
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [*argv_for(ENGINE_DEFAULTS), "--tensor-parallel-size", "2", "--kv-cache-dtype", "int8"]
    argv += ["--num-scheduler-steps", "4"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    command = [sys.executable, "-m", "jaxinfra", "serve", *argv, "--no-warmup", "--port", str(port)]
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        body = {"prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={**body, "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected
        chunks = []
        stream = {**body, "return_token_ids": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=stream, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[len("data: ") :])["choices"][0]["token_ids"])
        assert chunks == [[t] for t in expected]
    finally:
        proc.terminate()
        proc.wait(30)
