"""``python -m sglang_oasis.launch_pd``'s argument handling and supervision (the cluster itself runs in
test/integration/test_pd.py)."""

from __future__ import annotations

import pytest

from sglang_oasis import launch_pd


def test_server_arguments_pass_through_and_own_options_stay() -> None:
    args, server_args = launch_pd.parse(
        ["--port", "31000", "--model-path", "/m", "--oasis-top-k", "8", "--router-args=--disable-retries"]
    )
    assert (args.host, args.port, args.router_args) == ("127.0.0.1", 31000, "--disable-retries")
    assert server_args == ["--model-path", "/m", "--oasis-top-k", "8"]


def test_the_router_takes_a_restarted_server_back_within_seconds_unless_told_otherwise() -> None:
    argv = launch_pd.router_argv("http://p", 7000, "http://d", 9000, "--disable-retries")
    assert argv[:6] == ["--pd-disaggregation", "--prefill", "http://p", "7000", "--decode", "http://d"]
    assert argv[argv.index("--health-check-interval-secs") + 1] == "5"
    assert argv[argv.index("--cb-timeout-duration-secs") + 1] == "10"
    assert argv[-1] == "--disable-retries"
    own = launch_pd.router_argv("http://p", 7000, "http://d", 9000, "--health-check-interval-secs=30")
    assert "--health-check-interval-secs" not in own and own[-1] == "--health-check-interval-secs=30"
    assert own[own.index("--cb-timeout-duration-secs") + 1] == "10"
    assert argv[argv.index("--health-check-timeout-secs") + 1] == "30"


def test_the_router_circuit_breaker_is_off_unless_configured() -> None:
    """One server of each role: the breaker has nowhere else to send, so requests failing alone would
    open it and fail every request with 503; a dead server is still left out by the health checks."""
    assert "--disable-circuit-breaker" in launch_pd.router_argv("http://p", 7000, "http://d", 9000, "")
    own = launch_pd.router_argv("http://p", 7000, "http://d", 9000, "--cb-failure-threshold 50")
    assert "--disable-circuit-breaker" not in own and own[-2:] == ["--cb-failure-threshold", "50"]


@pytest.mark.parametrize("option", ["--disaggregation-mode", "--disaggregation-bootstrap-port"])
def test_options_the_launcher_sets_per_server_are_refused(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        launch_pd.parse([option, "prefill"])
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--tp-size", "2", "--decode-args=--tp-size 1"],
        ["--prefill-args=--tensor-parallel-size=2"],
        ["--tp", "2", "--decode-args=--tp 4"],
    ],
)
def test_a_sparse_pair_with_different_tp_sizes_is_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each decode rank reads its KV heads from the prefill rank of its own number: the sizes must match."""
    with pytest.raises(SystemExit) as exit_info:
        launch_pd.parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--tp-size: the prefill server's" in err and "differ" in err, err


def test_the_same_tp_size_for_both_or_a_dense_pair_starts() -> None:
    assert launch_pd.parse(["--tp-size", "2"])[1] == ["--tp-size", "2"]
    assert launch_pd.parse(["--prefill-args=--tp-size 2", "--decode-args=--tp=2"])[1] == []
    assert launch_pd.parse(["--oasis-mode", "dense", "--decode-args=--tp-size 2"])[1] == [
        "--oasis-mode",
        "dense",
    ]
    assert launch_pd.last_value(["--tp", "2", "--tp-size=3"], launch_pd.TENSOR_PARALLEL_OPTIONS, "1") == "3"


class FakeServer:
    """Pure logic stand-in for ServerProcess: dies on cue, counts restarts."""

    def __init__(self, lives: int) -> None:
        self.lives, self.restarts, self.log_path = lives, 0, "log"

    def alive(self) -> bool:
        self.lives -= 1
        return self.lives > 0

    def restart(self) -> None:
        self.restarts += 1
        self.lives = 3


def test_supervise_restarts_dead_servers_and_gives_up_after_max_restarts() -> None:
    prefill, decode, router = FakeServer(2), FakeServer(10**6), FakeServer(10**6)
    cluster = launch_pd.PDCluster(prefill, decode, router, 1)  # type: ignore[arg-type]
    assert launch_pd.supervise(cluster, max_restarts=2, period_s=0) == 1
    assert prefill.restarts == 2 and decode.restarts == 0
