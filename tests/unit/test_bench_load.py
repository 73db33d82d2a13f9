"""bench/load.py without a server or Ray: the workload, the math, the URL check, the report, and
the client end to end against a tiny in-process fake SSE server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import pathlib
import sys
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp.test_utils import TestServer  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = REPO_ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # where `python bench/load.py` finds its package

from loadgen.client import RequestResult, check_loopback_url, run_load, run_request  # noqa: E402
from loadgen.report import REPORT_KEYS, build_report, print_table  # noqa: E402
from loadgen.server_stats import settle  # noqa: E402
from loadgen.stats import percentile, summarize  # noqa: E402
from loadgen.workload import (  # noqa: E402
    CHAT_PATH,
    COMPLETION_PATH,
    LoadRequest,
    WorkloadSpec,
    make_workload,
    system_prompts,
)

from tests.unit.fake_sse_server import FIRST_TOKEN_S, GAP_S, FakeServer  # noqa: E402


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_load", BENCH / "load.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# -- workload ---------------------------------------------------------------------------------


def test_workload_is_deterministic_and_seeded() -> None:
    spec = WorkloadSpec(seed=7, shared_fraction=0.5, disconnect_fraction=0.25)
    a, b = make_workload(spec, 40), make_workload(spec, 40)
    assert [(r.path, r.body, r.disconnect_after) for r in a] == [
        (r.path, r.body, r.disconnect_after) for r in b
    ]
    other = make_workload(WorkloadSpec(seed=8, shared_fraction=0.5), 40)
    assert [r.body for r in a] != [r.body for r in other]
    # the shared system prompts do not depend on how many requests are made
    assert system_prompts(spec) == system_prompts(WorkloadSpec(seed=7, systems=4))


def test_workload_mix_is_exact() -> None:
    spec = WorkloadSpec(seed=1, shared_fraction=0.5, disconnect_fraction=0.25, max_tokens=32)
    requests = make_workload(spec, 200)
    chats = [r for r in requests if r.kind == "chat"]
    completions = [r for r in requests if r.kind == "completion"]
    assert len(chats) == 100 and len(completions) == 100
    assert [r.index for r in requests] == list(range(200))
    hang_ups = [r.disconnect_after for r in requests if r.disconnect_after is not None]
    assert len(hang_ups) == 50 and all(1 <= n <= 3 for n in hang_ups)
    systems = system_prompts(spec)
    assert all(r.path == CHAT_PATH and r.shared for r in chats)
    assert all(r.body["messages"][0]["content"] == systems[r.system_id] for r in chats)
    assert len({r.system_id for r in chats}) == spec.systems  # every system prompt is shared
    assert all(r.path == COMPLETION_PATH and not r.shared for r in completions)
    prompts = [r.body["prompt"] for r in completions]
    assert len(set(prompts)) == len(prompts)
    assert len({p.split()[0:2][1] for p in prompts}) == len(prompts)  # unique from the start
    for r in requests:
        assert r.body["stream"] is True and r.body["stream_options"] == {"include_usage": True}
        assert r.body["max_tokens"] == 32 and r.body["ignore_eos"] is True
        assert "model" not in r.body


def test_workload_extremes_and_validation() -> None:
    assert {r.kind for r in make_workload(WorkloadSpec(shared_fraction=0.0), 10)} == {"completion"}
    all_chats = make_workload(WorkloadSpec(shared_fraction=1.0, model="m"), 10)
    assert {r.kind for r in all_chats} == {"chat"}
    assert all(r.body["model"] == "m" for r in all_chats)
    for bad in (
        {"shared_fraction": 1.5},
        {"disconnect_fraction": -0.1},
        {"max_tokens": 0},
        {"user_words": (5, 2)},
    ):
        with pytest.raises(ValueError):
            WorkloadSpec(**bad)


# -- math ---------------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 25) == 2.0
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile([2.5], 99) == 2.5
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def _result(index: int, outcome: str = "ok", **kw: Any) -> RequestResult:
    r = RequestResult(index, kw.pop("kind", "completion"), False, float(index), index + 1.0)
    r.outcome = outcome
    for key, value in kw.items():
        setattr(r, key, value)
    return r


def _sample_results() -> list[RequestResult]:
    return [
        _result(
            0,
            chunk_s=[0.1, 0.2, 0.4],
            completion_tokens=5,
            prompt_tokens=100,
            cached_tokens=64,
            kind="chat",
        ),
        _result(1, "disconnected", chunk_s=[0.3, 0.35]),
        _result(2, "error", error_kind="http_503", error_detail="busy"),
        _result(3, "error", error_kind="timeout", error_detail="slow"),
        _result(4, "error", error_kind="http_503", error_detail="busy again"),
    ]


def test_summary_counts_and_latencies() -> None:
    s = summarize(_sample_results(), seconds=2.0)
    assert (s.requests, s.ok, s.disconnected, s.errors) == (5, 1, 1, 3)
    assert s.errors_by_kind == {"http_503": 2, "timeout": 1}
    assert s.requests_per_s == 0.5
    assert s.generated_tokens == 5 and s.tokens_per_s == 2.5
    assert s.cached_fraction == 0.64
    assert s.ttft_p50_s == pytest.approx(0.2)  # over ok and hung-up requests: 0.1, 0.3
    assert s.itl_samples == 3  # 0.1, 0.2 and 0.05
    assert s.itl_p50_s == pytest.approx(0.1)
    assert s.tpot_p50_s == pytest.approx(0.3 / 4)
    with pytest.raises(ValueError):
        summarize([], seconds=0)


# -- URL check ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000",
        "http://127.1.2.3/",
        "http://localhost:8000/",
        "http://[::1]:8000",
        "https://LOCALHOST",
    ],
)
def test_loopback_urls_are_accepted(url: str) -> None:
    assert check_loopback_url(url) == url.rstrip("/")


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1:8000",
        "http://example.com",
        "http://0.0.0.0:8000",
        "ftp://127.0.0.1",
        "http://127.0.0.1.nip.io",
        "127.0.0.1:8000",
        "http://[::2]:80",
        "http://",
    ],
)
def test_other_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        check_loopback_url(url)


def test_cli_refuses_a_remote_url(capsys: pytest.CaptureFixture[str]) -> None:
    load = _load_script()
    with pytest.raises(SystemExit):
        load.parse_args(["--url", "http://192.168.1.10:8000"])
    assert "not loopback" in capsys.readouterr().err


def test_own_app_preset_overrides_replicas_and_cache() -> None:
    from deployments.preset import Preset

    load = _load_script()
    args = load.parse_args(["--replicas", "3", "--max-num-tokens", "4096"])
    raw = load.app_preset(args)
    preset = Preset.parse(raw)
    assert preset.serving.num_replicas == 3 and preset.engine.max_num_tokens == 4096


# -- report -------------------------------------------------------------------------------------


def _report(results: list[RequestResult]) -> dict[str, Any]:
    replica = {"pages_in_use": 0, "jobs_running": 0, "jobs_waiting": 0, "requests_active": 0}
    return build_report(
        date="2025-01-01T00:00:00+00:00",
        machine={"cpu_cores": 2},
        target={"url": "http://127.0.0.1:1"},
        workload={
            "clients": 2,
            "max_tokens": 8,
            "shared_fraction": 0.5,
            "disconnect_fraction": 0.25,
        },
        summary=summarize(results, 2.0),
        results=results,
        server={
            "before": [replica],
            "after": [replica, replica],
            "settled": True,
            "settle_wait_s": 0.1,
            "held": {},
        },
    )


def test_report_json_shape_and_table(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = _sample_results()
    report = json.loads(json.dumps(_report(results)))  # JSON-clean
    assert tuple(report) == REPORT_KEYS
    assert report["errors"] == {"http_503": "busy", "timeout": "slow"}
    first = report["requests"][0]
    assert set(first) == {
        "index",
        "kind",
        "shared",
        "start_s",
        "end_s",
        "outcome",
        "error_kind",
        "ttft_s",
        "itl_s",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
    }
    assert first["ttft_s"] == 0.1 and first["itl_s"] == [0.1, 0.2]
    print_table(report)
    out = capsys.readouterr().out
    for label in ("throughput", "TTFT", "ITL", "http_503: 2", "leak check    clean"):
        assert label in out
    pytest.importorskip("matplotlib")
    json_path, png_path = _load_script().write_outputs(report, results, tmp_path, "t")
    assert json.loads(json_path.read_text())["benchmark"] == "load"
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the client against a fake SSE server -------------------------------------------------------


def _request(index: int, mode: str, chat: bool = False, hang_up: int | None = None):
    body: dict[str, Any] = {
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": f"mode:{mode}"},
        ]
        return LoadRequest(index, "chat", CHAT_PATH, body, 0, hang_up)
    body["prompt"] = f"mode:{mode}"
    return LoadRequest(index, "completion", COMPLETION_PATH, body, None, hang_up)


CASES = [  # (mode, chat, hang up after, outcome, error kind)
    ("ok", False, None, "ok", None),
    ("ok", True, None, "ok", None),
    ("error", False, None, "error", "sse_error"),
    ("http503", False, None, "error", "http_503"),
    ("reset", False, None, "error", "connection_reset"),
    ("truncated", True, None, "error", "truncated"),
    ("nousage", False, None, "error", "no_usage"),
    ("badjson", False, None, "error", "protocol"),
    ("slow", False, None, "error", "timeout"),
    ("hangup", False, 2, "disconnected", None),
]


async def _client_run(fake: FakeServer) -> tuple[list[RequestResult], float]:
    server = TestServer(fake.app, host="127.0.0.1")
    await server.start_server()
    try:
        base = str(server.make_url("")).rstrip("/")
        requests = [
            _request(i, mode, chat, hang) for i, (mode, chat, hang, _, _) in enumerate(CASES)
        ]
        run = await run_load(
            base, requests, clients=len(requests), duration_s=5, request_timeout_s=0.6
        )
        for _ in range(20):  # the server notices the hang-up at its next write
            if fake.hung_up:
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as session:  # a closed port: refused at once
            closed = LoadRequest(99, "completion", COMPLETION_PATH, {"prompt": "x"})
            refused = await run_request(session, "http://127.0.0.1:9", closed, 1.0, 0.0)
        return [*run.results, refused], run.seconds
    finally:
        await server.close()


def test_client_timing_and_errors_against_a_fake_server() -> None:
    fake = FakeServer()
    results, seconds = asyncio.run(_client_run(fake))
    # All concurrent: the run is shorter than its requests one after another (no wall-clock
    # bound: a busy CI machine may stretch every sleep).
    assert seconds < sum(r.end_s - r.start_s for r in results[:-1])
    by_index = {r.index: r for r in results}
    for i, (mode, _, _, outcome, kind) in enumerate(CASES):
        assert (by_index[i].outcome, by_index[i].error_kind) == (outcome, kind), mode
    assert by_index[99].error_kind == "connection_refused"
    for r in (by_index[0], by_index[1]):  # completion and chat (its role chunk is no token)
        assert r.ttft_s >= FIRST_TOKEN_S * 0.9
        assert len(r.itl_s) == 2
        assert all(gap >= GAP_S * 0.8 for gap in r.itl_s)
        assert r.ttft_s + sum(r.itl_s) <= r.end_s - r.start_s  # parts of the request, in order
        assert (r.prompt_tokens, r.completion_tokens) == (7, 3)
    hung = by_index[9]
    assert len(hung.chunk_s) == 2 and hung.outcome == "disconnected"
    assert fake.hung_up == 1  # the server saw the client go away
    assert "boom" in by_index[2].error_detail and "overloaded" in by_index[3].error_detail


def test_measure_end_to_end_against_a_fake_server(tmp_path: pathlib.Path) -> None:
    load = _load_script()

    async def run() -> tuple[dict[str, Any], list[RequestResult]]:
        fake = FakeServer()
        server = TestServer(fake.app, host="127.0.0.1")
        await server.start_server()
        try:
            url = str(server.make_url("")).rstrip("/")
            args = load.parse_args(
                [
                    "--url",
                    url,
                    "--clients",
                    "3",
                    "--requests",
                    "8",
                    "--duration",
                    "5",
                    "--max-tokens",
                    "3",
                    "--disconnect-fraction",
                    "0.25",
                    "--settle-timeout",
                    "1",
                    "--system-words",
                    "20",
                ]
            )
            return await load.measure(url, args, {"started_here": False})
        finally:
            await server.close()

    report, _ = asyncio.run(run())
    s = report["summary"]
    assert (s["requests"], s["ok"], s["disconnected"], s["errors"]) == (8, 6, 2, 0)
    assert s["generated_tokens"] == 18
    assert report["target"]["model"] == "fake"
    assert report["workload"]["ran"] == {
        "requests": 8,
        "shared_chats": 4,
        "unique_completions": 4,
        "planned_disconnects": 2,
    }
    assert report["server"]["settled"] is True and len(report["server"]["after"]) == 1


def test_settle_reports_what_stays_in_use() -> None:
    async def run() -> Any:
        fake = FakeServer()
        fake.stats["pages_in_use"] = 12
        server = TestServer(fake.app, host="127.0.0.1")
        await server.start_server()
        try:
            return await settle(str(server.make_url("")).rstrip("/"), 0.2, poll_s=0.05)
        finally:
            await server.close()

    result = asyncio.run(run())
    assert result.settled is False and result.held == {"pages_in_use": 12}
    assert result.waited_s >= 0.2
