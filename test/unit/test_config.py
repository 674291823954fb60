"""OasisConfig validation and the launcher's argument handling (no server)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

import pytest

from sglang_oasis.config import ENV_VAR, OasisConfig, OasisConfigError
from sglang_oasis.launch_server import split_argv
from sglang_oasis.launcher.argv import LaunchError, given, option_value
from sglang_oasis.launcher.cpu_engine import (
    DECODE_STEP_ENV,
    INDUCTOR_CACHE_ENV,
    WARMUP_TIMEOUT_ENV,
    compile_plan,
    cpu_decode_step,
    cpu_defaults,
)
from sglang_oasis.server_process import child_env


def test_cli_defaults_come_from_the_dataclass() -> None:
    parser = argparse.ArgumentParser()
    OasisConfig.add_cli_args(parser)
    assert OasisConfig.from_cli_args(parser.parse_args([])) == OasisConfig()


def test_cli_parses_every_field() -> None:
    config, rest = split_argv(
        [
            "--oasis-mode",
            "dense",
            "--oasis-cpu-defaults",
            "false",
            "--oasis-cpu-max-total-tokens=1234",
            "--oasis-remote-fetch",
            "false",
            "--port",
            "9",
        ]
    )
    assert config == OasisConfig(
        mode="dense", cpu_defaults=False, cpu_max_total_tokens=1234, remote_fetch=False
    )
    assert OasisConfig().mode == "sparse"
    assert rest == ["--port", "9"]


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"mode": "bogus"}, "--oasis-mode"),
        ({"cpu_max_total_tokens": 0}, "--oasis-cpu-max-total-tokens"),
        ({"remote_fetch_ttl": 0}, "--oasis-remote-fetch-ttl"),
        ({"sink_blocks": -1}, "--oasis-sink-blocks"),
        ({"prefill_window": -1}, "--oasis-prefill-window"),
        ({"window_keep": 1.5}, "--oasis-window-keep"),
        ({"host_memory_fraction": 1.5}, "--oasis-host-memory-fraction"),
        # a budget below one working set used to become one running request (or an opaque OOM)
        ({"top_k": 128, "device_kv_tokens": 2047}, "--oasis-device-kv-tokens: 2047 tokens do not hold"),
        ({"top_k": 100_000}, "raise it or lower --oasis-top-k"),
        (
            {"top_k": 128, "sink_blocks": 1, "device_kv_tokens": 2048},
            r"\(--oasis-top-k 128 \+ --oasis-sink-blocks 1\)",
        ),
        ({"recall_target": 1.0}, "--oasis-recall-target: must be in"),
        ({"recall_target": -0.1}, "--oasis-recall-target: must be in"),
        ({"recall_target": 0.9, "recall_sample_every": 0}, "--oasis-recall-target: needs recall samples"),
        ({"recall_max_top_k": 8}, "--oasis-recall-max-top-k: must be at least --oasis-top-k"),
        # the target reserves its maximum (4 x 128 blocks of 16) per layer and KV head
        ({"top_k": 128, "recall_target": 0.9, "device_kv_tokens": 8191}, r"\(--oasis-top-k 512 \+"),
    ],
)
def test_invalid_values_name_the_option(kwargs: dict, option: str) -> None:
    with pytest.raises(OasisConfigError, match=option):
        OasisConfig(**kwargs)


def test_config_travels_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert OasisConfig.from_env() is None
    config = OasisConfig(cpu_max_total_tokens=999)
    config.to_env()
    assert json.loads(__import__("os").environ[ENV_VAR])["cpu_max_total_tokens"] == 999
    assert OasisConfig.from_env() == config


def test_cpu_defaults_only_fill_what_is_missing() -> None:
    config = OasisConfig()
    added = cpu_defaults([], config)
    assert option_value(added, "--device") == "cpu"
    assert option_value(added, "--attention-backend") == "torch_native"
    assert option_value(added, "--max-total-tokens") == str(config.cpu_max_total_tokens)
    assert given(added, "--sleep-on-idle")

    explicit = [
        "--attention-backend",
        "triton",
        "--max-total-tokens=100",
        "--sleep-on-idle",
        "--device",
        "cpu",
    ]
    assert cpu_defaults(explicit, config) == []
    assert cpu_defaults(["--mem-fraction-static", "0.1"], config).count("--max-total-tokens") == 0
    assert cpu_defaults([], OasisConfig(cpu_defaults=False)) == ["--device", "cpu"]


def test_the_cpu_default_decode_step_is_the_faster_unless_told(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """The launcher's CPU default: the captured step with the summaries, its compiles cached under the
    project's cache, the eager step with codes; an explicit --oasis-decode-step, --oasis-adaptive-cap (which
    the captured step refuses), no fetch cap (where it loses) or the environment wins."""
    monkeypatch.delenv(DECODE_STEP_ENV, raising=False)
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.setenv("SGLANG_OASIS_CACHE", str(tmp_path))
    monkeypatch.delenv(WARMUP_TIMEOUT_ENV, raising=False)
    summaries = OasisConfig(selector="summaries")
    assert cpu_decode_step([], summaries).decode_step == "captured"
    # the default selector, codes: the eager step (faster with codes on CPU), unless told
    assert cpu_decode_step([], OasisConfig()).decode_step == "eager"
    # what compiles before the server is ready, said; torch's cache under the project's; SGLang's warm-up
    # (where it compiles) given the time it may take
    plan = compile_plan(["--max-running-requests", "20"], OasisConfig(decode_step="captured"))
    assert "12 programs compile before the server is ready (batch buckets 1, 2, 4, 8, 16, 32;" in plan
    assert "decode and decode+sample passes) as 4 graphs" in plan  # one row; the rest (a symbolic batch)
    assert __import__("os").environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "torchinductor")
    assert __import__("os").environ[WARMUP_TIMEOUT_ENV] == "720"
    bounded = ["--max-running-requests", "20", "--cuda-graph-max-bs-decode", "3"]
    assert "6 programs compile before the server is ready (batch buckets 1, 2, 4;" in compile_plan(
        bounded, OasisConfig(decode_step="captured", lookahead="ngram")
    )
    assert "verify and verify+sample passes" in compile_plan(bounded, OasisConfig(lookahead="ngram"))
    # --cuda-graph-bs-decode's sizes: the buckets holding them, as the server compiles (buckets_ahead)
    sized = ["--max-running-requests", "20", "--cuda-graph-bs-decode", "3", "24", "--dtype", "float32"]
    sized_plan = compile_plan(sized, OasisConfig(decode_step="captured"))
    assert "4 programs compile before the server is ready (batch buckets 4, 32;" in sized_plan
    assert "decode+sample passes) as 2 graphs" in sized_plan  # 4 and 32 rows share theirs
    for argv in (["--oasis-decode-step", "eager"], ["--oasis-decode-step=eager"]):
        assert cpu_decode_step(argv, summaries).decode_step == "eager"
    assert cpu_decode_step([], OasisConfig(selector="summaries", adaptive_cap=True)).decode_step == "eager"
    no_cap = OasisConfig(selector="summaries", fetch_ratio=1.0)
    assert cpu_decode_step([], no_cap).decode_step == "eager"  # no cap: eager wins
    oracle = OasisConfig(selector="oracle", evaluation_only=True)  # its attention replaces the eager step's
    assert cpu_decode_step([], oracle).decode_step == "eager"
    monkeypatch.setenv(DECODE_STEP_ENV, "eager")
    assert cpu_decode_step([], summaries).decode_step == "eager"
    monkeypatch.setenv(DECODE_STEP_ENV, "captured")
    assert cpu_decode_step([], OasisConfig()).decode_step == "captured"  # codes captured (coded_selection.py)
    monkeypatch.setenv(DECODE_STEP_ENV, "graph")
    with pytest.raises(LaunchError, match=DECODE_STEP_ENV):
        cpu_decode_step([], OasisConfig())


def test_a_fresh_launcher_gives_the_servers_torchs_cache_under_the_projects(tmp_path) -> None:
    """In a fresh process (as the launcher runs), not only in this one: importing torch._dynamo sets torch's
    default cache directory (/tmp, emptied by a reboot), so the launcher must set its own first. A server's
    processes inherit the launcher's environment; a value the user set is kept."""
    from sglang_oasis.models.default_model import prepare_default_model

    argv = ["--model-path", str(prepare_default_model()), "--oasis-decode-step", "captured",
            "--max-running-requests", "2"]  # fmt: skip
    code = (
        f"import os; from sglang_oasis.launch_server import prepare; prepare({argv!r}); "
        "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    )
    env = {**child_env(), "SGLANG_OASIS_CACHE": str(tmp_path), "SGLANG_OASIS_CPU_DECODE_STEP": ""}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == str(tmp_path / "torchinductor")
    assert f"~2 s each from {tmp_path / 'torchinductor'}" in run.stderr + run.stdout
    # torch's default, passed on by a parent that imported torch._dynamo (as pytest has): not the user's
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env["TORCHINDUCTOR_CACHE_DIR"] = __import__("os").path.abspath(default_cache_dir())
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(tempfile.gettempdir())
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.stdout.strip().splitlines()[-1] == str(tmp_path / "torchinductor")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "mine")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.stdout.strip().splitlines()[-1] == str(tmp_path / "mine")


def test_an_explicit_captured_step_without_a_fetch_cap_is_warned_about(
    capsys: pytest.CaptureFixture[str],
) -> None:
    explicit = ["--oasis-decode-step", "captured", "--oasis-fetch-ratio", "1"]
    assert (
        cpu_decode_step(explicit, OasisConfig(decode_step="captured", fetch_ratio=1.0)).decode_step
        == "captured"
    )
    assert "copies a whole working set per KV head every step" in capsys.readouterr().err
    cpu_decode_step(explicit[:2], OasisConfig(decode_step="captured"))  # the default cap: nothing to say
    assert "whole working set" not in capsys.readouterr().err


def test_a_pd_decode_server_on_cpu_backs_up_retracted_requests_in_plain_tensors() -> None:
    config = OasisConfig()
    decode = ["--disaggregation-mode", "decode"]
    assert (
        option_value(cpu_defaults(decode, config), "--disaggregation-decode-retraction-backup")
        == "cpu_tensor"
    )
    for explicit in (
        ["--disaggregation-decode-retraction-backup", "none"],
        ["--disaggregation-decode-enable-radix-cache"],
    ):
        assert not given(cpu_defaults(decode + explicit, config), "--disaggregation-decode-retraction-backup")
    assert not given(
        cpu_defaults(["--disaggregation-mode", "prefill"], config),
        "--disaggregation-decode-retraction-backup",
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--oasis-mode", "bogus"], "--oasis-mode"),
        (["--oasis-cpu-max-total-tokens", "-5"], "--oasis-cpu-max-total-tokens"),
        (["--oasis-no-such-option", "1"], "--oasis-no-such-option"),
        (["--oasis-cpu-defaults", "maybe"], "--oasis-cpu-defaults"),
        # sparse mode refuses SGLang options that contradict it
        (["--attention-backend", "triton"], "--attention-backend triton"),
        (["--page-size", "32"], "--page-size 32"),
        (["--enable-mixed-chunk"], "--enable-mixed-chunk: sparse mode"),
        (["--dp", "2"], "--dp 2: sparse mode runs one engine replica"),  # tensor parallelism it serves
        (["--pp-size", "2"], "--pp-size 2: sparse mode runs one engine replica"),
        (["--max-total-tokens", "100", "--oasis-host-kv-tokens", "200"], "--oasis-host-kv-tokens"),
        (["--oasis-host-kv-tokens", str(10**12)], "more than the"),  # more KV than the host RAM holds
        (["--oasis-host-memory-fraction", "0"], "--oasis-host-memory-fraction"),
        (["--oasis-recall-target", "1.5"], "--oasis-recall-target: must be in [0, 1)"),
        (["--dtype", "bogus"], "--dtype bogus"),  # refused by the host tier's sizing, naming it
        (["--oasis-dense-layers", "3,30"], "--oasis-dense-layers 30: the model has 30 layers"),
        (
            ["--oasis-top-k", "128", "--oasis-device-kv-tokens", "1024"],
            "--oasis-device-kv-tokens: 1024 tokens do not hold",
        ),
        (["--oasis-device-kv-tokens", str(10**9)], "are both host RAM, more than the"),
        (["--device", "cuda"], "--oasis-cuda-untested true to try the untested CUDA path"),
        (
            ["--device", "cuda", "--oasis-cuda-untested", "true", "--tp-size", "2"],
            "--tp-size 2 with CUDA graphs",
        ),
        (
            ["--device", "cuda", "--oasis-cuda-untested", "true", "--oasis-decode-step", "eager"],
            "--oasis-decode-step eager on CUDA",
        ),
        (
            ["--device", "cuda", "--oasis-cuda-untested", "true", "--oasis-dense-layers", "0"],
            "--disable-cuda-graph",
        ),
        (
            ["--device", "cuda", "--oasis-cuda-untested", "true", "--oasis-lookahead", "ngram"],
            "--disable-cuda-graph",
        ),
        (["--oasis-lookahead", "medusa"], "--oasis-lookahead"),
        (["--oasis-draft-policy", "maybe"], "--oasis-draft-policy"),
        (["--oasis-decode-step", "graph"], "--oasis-decode-step"),
        (["--oasis-prefill-attention", "flash"], "--oasis-prefill-attention"),
        (["--oasis-prefill-attention", "triton"], "--oasis-prefill-attention triton on cpu"),
        (["--oasis-decode-step", "captured", "--oasis-adaptive-cap", "true"], "--oasis-decode-step captured"),
        (["--oasis-selector", "oracle"], "add --oasis-evaluation-only true"),
        (["--oasis-selector", "exact"], "--oasis-selector"),
        (
            [
                "--oasis-selector",
                "oracle",
                "--oasis-evaluation-only",
                "true",
                "--disaggregation-mode",
                "decode",
            ],
            "a PD decode node's blocks",
        ),
        (["--speculative-algorithm", "EAGLE3"], "--speculative-algorithm"),
        (["--speculative-draft-model-path", "/x"], "--speculative-draft-model-path needs --oasis-lookahead"),
        (["--oasis-lookahead", "eagle3", "--model-path", "/x"], "needs --speculative-draft-model-path"),
        (["--enable-torch-compile"], "--enable-torch-compile: sparse mode's decode step does not run"),
        (
            ["--oasis-mode", "dense", "--enable-torch-compile"],
            "--enable-torch-compile: SGLang's torch_native",
        ),
    ],
)
def test_bad_oasis_option_stops_startup_naming_it(argv: list[str], needle: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sglang_oasis.launch_server", *argv],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert needle in result.stderr


def test_sparse_mode_adds_backend_and_pages() -> None:
    from sglang_oasis.launcher.sparse_mode import sparse_mode_args

    config = OasisConfig(top_k=32, sink_blocks=0, block_size=16, device_kv_tokens=8192, host_kv_tokens=4096)
    added = sparse_mode_args([], config)
    assert option_value(added, "--attention-backend") == "oasis"
    assert option_value(added, "--page-size") == "16"
    assert option_value(added, "--max-total-tokens") == "4096"
    assert option_value(added, "--cuda-graph-backend-decode") == "disabled"
    on_gpu = sparse_mode_args([], config, on_cpu=False)  # --oasis-cuda-untested: SGLang captures decode
    assert option_value(on_gpu, "--cuda-graph-backend-decode") is None
    assert option_value(on_gpu, "--cuda-graph-backend-prefill") == "disabled"
    explicit = sparse_mode_args(["--page-size", "16"], config)
    assert not given(explicit, "--page-size")


def test_lookahead_sets_up_one_step_speculation() -> None:
    """Two verify rows per request (the real token and one draft), top-k 1, from the chosen drafter."""
    from sglang_oasis.launcher.sparse_mode import lookahead_args

    assert lookahead_args([], OasisConfig()) == []
    ngram = lookahead_args([], OasisConfig(lookahead="ngram"))
    assert option_value(ngram, "--speculative-algorithm") == "NGRAM"
    assert option_value(ngram, "--speculative-num-draft-tokens") == "2"
    assert option_value(ngram, "--speculative-ngram-max-bfs-breadth") == "1"
    eagle = lookahead_args(
        ["--model-path", "/m", "--speculative-draft-model-path", "/d"], OasisConfig(lookahead="eagle3")
    )
    assert option_value(eagle, "--speculative-algorithm") == "EAGLE3"
    assert [
        option_value(eagle, f"--speculative-{name}")
        for name in ("num-steps", "eagle-topk", "num-draft-tokens")
    ] == [
        "1",
        "1",
        "2",
    ]
    assert not given(eagle, "--speculative-draft-model-path")  # the user's own stays


def test_dense_layers_parse_and_normalise() -> None:
    config, _ = split_argv(["--oasis-dense-layers", "3,0,3"])
    assert config.dense_layers == (0, 3)
    with pytest.raises(OasisConfigError, match="--oasis-dense-layers"):
        OasisConfig(dense_layers=(-1,))


def test_a_working_set_budget_matters_only_in_sparse_mode() -> None:
    assert OasisConfig(mode="dense", device_kv_tokens=16).device_kv_tokens == 16
    assert OasisConfig(top_k=4, device_kv_tokens=64).working_set_tokens == 64


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        ({"model_type": "deepseek_v3", "num_hidden_layers": 4, "kv_lora_rank": 512}, "multi-head latent attention"),
        ({"model_type": "mistral", "num_hidden_layers": 4, "sliding_window": 4096}, "sliding-window attention"),
        (
            {"model_type": "gemma3_text", "num_hidden_layers": 2, "sliding_window": 512,
             "layer_types": ["sliding_attention", "full_attention"]},
            "gemma3_text uses sliding-window attention",
        ),
        ({"model_type": "m", "text_config": {"num_hidden_layers": 2, "kv_lora_rank": 8}}, "(MLA)"),
    ],
)  # fmt: skip
def test_sparse_mode_refuses_models_it_would_serve_wrongly(tmp_path, model: dict, needle: str) -> None:
    from sglang_oasis.launcher.argv import LaunchError
    from sglang_oasis.launcher.sparse_mode import check_sparse_model

    (tmp_path / "config.json").write_text(json.dumps(model))
    with pytest.raises(LaunchError, match=needle):
        check_sparse_model(["--model-path", str(tmp_path)], OasisConfig())


@pytest.mark.parametrize(
    "model",
    [
        {"model_type": "llama", "num_hidden_layers": 30},
        # Qwen2/Qwen3 configs name a window they do not use
        {"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 32768, "use_sliding_window": False},
        {"model_type": "qwen3", "num_hidden_layers": 2, "sliding_window": None,
         "layer_types": ["full_attention", "full_attention"]},
    ],
)  # fmt: skip
def test_sparse_mode_serves_full_attention_models(tmp_path, model: dict) -> None:
    from sglang_oasis.launcher.sparse_mode import check_sparse_model

    (tmp_path / "config.json").write_text(json.dumps(model))
    check_sparse_model(["--model-path", str(tmp_path)], OasisConfig(dense_layers=(0, 1)))
    check_sparse_model(["--model-path", str(tmp_path / "hub-id")], OasisConfig(dense_layers=(99,)))


def test_on_cpu_the_two_tiers_must_fit_the_ram_together(default_model_dir) -> None:
    from sglang_oasis.launcher.argv import LaunchError
    from sglang_oasis.launcher.sparse_mode import check_tiers_fit

    argv = ["--model-path", str(default_model_dir), "--dtype", "float32", "--max-total-tokens", "32768"]
    per_token = 46_080  # SmolLM2-135M in float32
    config = OasisConfig(device_kv_tokens=65536)
    check_tiers_fit(argv, config, available=(32768 + 65536) * per_token)
    with pytest.raises(
        LaunchError, match=r"--oasis-device-kv-tokens 65536: on CPU the working sets \(2.81 GiB\)"
    ):
        check_tiers_fit(argv, config, available=(32768 + 65536) * per_token - 1)
    check_tiers_fit(["--model-path", "/hub-id", "--max-total-tokens", "8"], config, available=1)
