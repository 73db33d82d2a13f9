"""bench/serving_overhead.py without Ray or a model: arguments, the workload, the statistics and
ratios, the report and its table, the CPU accounting of an app's processes, and the client's
text capture against the in-process fake SSE server."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import pathlib
import sys
import time

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp.test_utils import TestServer  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = REPO_ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # where `python bench/serving_overhead.py` finds loadgen

from loadgen.app_process import (  # noqa: E402
    cpu_used,
    group_alive,
    parse_stat,
    process_label,
    session_cpu,
    stop_leftovers,
)
from loadgen.client import RequestResult, run_request  # noqa: E402

from tests.unit.fake_sse_server import FakeServer  # noqa: E402


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "bench_serving_overhead", BENCH / "serving_overhead.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


so = _load_script()


def _result(index: int, chunks: list[float], tokens: int, text: str = "", ok: bool = True):
    r = RequestResult(index, "completion", False, 0.0, chunk_s=chunks, completion_tokens=tokens)
    r.text = text
    if not ok:
        r.fail("timeout", "x")
    return r


# -- arguments --------------------------------------------------------------------------------


def test_defaults_are_the_issue_workload() -> None:
    args = so.parse_args([])
    assert (args.streams, args.requests, args.max_tokens) == (64, 64, 32)
    assert args.served == [("this", REPO_ROOT)]
    assert args.name.startswith("serving-overhead-")


def test_served_variants_and_ranges_parse() -> None:
    args = so.parse_args(
        ["--served", f"a={REPO_ROOT}", "--served", f"b={REPO_ROOT}", "--prompt-words", "3:9"]
    )
    assert [name for name, _ in args.served] == ["a", "b"]
    assert args.prompt_words == (3, 9)
    assert so.parse_args(["--streams", "8"]).requests == 8


@pytest.mark.parametrize(
    "argv",
    [
        ["--served", "noequals"],
        ["--served", "x=/nonexistent/checkout"],
        ["--served", f"bare={REPO_ROOT}"],
        ["--served", f"a={REPO_ROOT}", "--served", f"a={REPO_ROOT}"],
        ["--served", f"a={REPO_ROOT}", "--bare-also", f"a={REPO_ROOT}"],
        ["--bare-also", f"b={REPO_ROOT}", "--no-bare"],
        ["--no-served", "--served", f"a={REPO_ROOT}"],
        ["--no-served", "--no-bare"],
        ["--prompt-words", "9:3"],
        ["--prompt-words", "a:b"],
        ["--streams", "0"],
        ["--max-tokens", "0"],
        ["--requests", "0"],
        ["--set", "stream_interval_s=0.2"],
        ["--set", "serving.x"],
        ["--set", "serving.router=[unclosed"],
        ["--host-cpus", "0"],  # without serving.engine_cpus
        ["--host-cpus", "1-0", "--set", "serving.engine_cpus=[2]"],
    ],
)
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        so.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_host_cpus_come_with_the_engine_cores() -> None:
    args = so.parse_args(["--host-cpus", "0", "--set", "serving.engine_cpus=[1]"])
    assert args.host_cpus == (0,) and args.set == [("serving", "engine_cpus", [1])]
    assert so.parse_args([]).host_cpus is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="core affinity is Linux-only")
def test_the_served_block_runs_on_the_host_cpus_and_restores_them() -> None:
    before = os.sched_getaffinity(0)
    one = (min(before),)
    with so.cpus_of_this_thread(one):
        assert os.sched_getaffinity(0) == set(one)
    assert os.sched_getaffinity(0) == before
    with so.cpus_of_this_thread(None):
        assert os.sched_getaffinity(0) == before


def test_workload_is_greedy_unique_and_fixed_length() -> None:
    args = so.parse_args(["--streams", "6", "--max-tokens", "5", "--prompt-words", "2:50"])
    requests = so.workload(args)
    assert len(requests) == 6
    assert all(r.kind == "completion" for r in requests)
    bodies = [r.body for r in requests]
    assert all(b["temperature"] == 0.0 and b["ignore_eos"] and b["max_tokens"] == 5 for b in bodies)
    assert len({b["prompt"] for b in bodies}) == 6
    assert len({len(b["prompt"].split()) for b in bodies}) > 1  # mixed lengths
    warm = so.warm_up_request(requests)
    assert warm.index == -1 and warm.body["max_tokens"] == 2


# -- statistics -------------------------------------------------------------------------------


def test_summary_of_one_path() -> None:
    results = [
        _result(0, [0.1, 0.2, 0.4], 4),  # 3 deliveries of 4 tokens
        _result(1, [0.3, 0.5], 2),
        _result(2, [0.9], 1, ok=False),  # errors count in nothing else
    ]
    s = so.summarize_path(results, 2.0, {"replica": 1.5, "proxy": 0.5})
    assert (s.requests, s.ok, s.errors, s.generated_tokens) == (3, 2, 1, 6)
    assert s.tokens_per_s == 3.0
    assert s.ttft_p50_s == pytest.approx(0.2)
    assert s.itl_p50_s == pytest.approx(0.2)  # gaps 0.1, 0.2, 0.2
    assert s.tpot_p50_s == pytest.approx((0.1 + 0.2) / 2)  # (0.4-0.1)/3 and (0.5-0.3)/1
    assert s.tokens_per_delivery == pytest.approx(6 / 5)
    assert s.cpu_s == 2.0 and s.cpu_ms_per_token == pytest.approx(2000 / 6)
    with pytest.raises(ValueError, match="seconds"):
        so.summarize_path(results, 0.0)
    empty = so.summarize_path([], 1.0)
    assert empty.ttft_p50_s is None and empty.cpu_s is None and empty.tokens_per_delivery is None


def test_ratios_and_goals() -> None:
    bare = so.summarize_path([_result(0, [0.1, 0.2, 0.3], 3)], 1.0, {"bare": 3.0})
    served = so.summarize_path([_result(0, [0.2, 0.3, 0.4], 3)], 1.25, {"r": 6.0})
    r = so.ratios(served, bare)
    assert r["tokens_per_s"] == pytest.approx(0.8)
    assert r["ttft_p50_s"] == pytest.approx(2.0)
    assert r["itl_p50_s"] == pytest.approx(1.0)
    assert r["cpu_ms_per_token"] == pytest.approx(2.0)
    g = so.goals(r)
    assert g == {
        "throughput_ge_90pct": False,
        "itl_p50_within_1_2x": True,
        "tpot_p50_within_1_2x": True,
    }
    missing = so.ratios(served, so.summarize_path([], 1.0))
    assert missing["ttft_p50_s"] is None and missing["tokens_per_s"] is None
    assert so.goals(missing)["throughput_ge_90pct"] is None


def test_text_agreement_compares_by_request() -> None:
    reference = [_result(0, [0.1], 1, "a"), _result(1, [0.1], 1, "b"), _result(2, [], 0, ok=False)]
    results = [_result(1, [0.1], 1, "b"), _result(0, [0.1], 1, "x"), _result(2, [0.1], 1, "c")]
    assert so.text_agreement(results, reference) == {"compared": 2, "same": 1}


def test_path_run_round_trips_through_json(tmp_path: pathlib.Path) -> None:
    run = so.PathRun([_result(0, [0.1, 0.2], 2, "hi"), _result(1, [], 0, ok=False)], 1.5, {"b": 1})
    so.dump_path_run(run, tmp_path / "run.json")
    back = so.load_path_run(tmp_path / "run.json")
    assert back == run


# -- report -----------------------------------------------------------------------------------


def test_report_and_table(tmp_path: pathlib.Path) -> None:
    args = so.parse_args(["--served", f"main={REPO_ROOT}", "--streams", "2"])
    runs = {
        "bare": so.PathRun([_result(0, [0.1, 0.2], 2, "t"), _result(1, [0.1], 1, "u")], 1.0, {}),
        "main": so.PathRun([_result(0, [0.2, 0.4], 2, "t"), _result(1, [0.3], 1, "v")], 2.0, {}),
    }
    runs["bare"].cpu = {"bare": 0.5}
    runs["main"].cpu = {"ray::ProxyActor": 0.2, "ray::ServeReplica:x": 0.6, "idle": 0.0}
    report = so.build_report(args, runs, {"cpu_cores": 2, "note": "test"})
    assert json.loads(json.dumps(report)) == report  # JSON-ready
    assert set(report["paths"]) == {"bare", "main"}
    vs = report["vs_bare"]["main"]
    assert vs["ratios"]["tokens_per_s"] == pytest.approx(0.5)
    assert vs["text"] == {"compared": 2, "same": 1}
    assert report["cpu_s_by_process"]["main"] == {
        "ray::ServeReplica:x": 0.6,
        "ray::ProxyActor": 0.2,
    }
    assert report["workload"]["streams"] == 2 and report["machine"]["note"] == "test"
    lines = so.table(report)
    assert lines[1].startswith("bare") and lines[2].startswith("main")
    assert "main / bare" in lines[3] and "same text 1/2" in lines[3]
    no_bare = so.build_report(args, {"main": runs["main"]}, {})
    assert no_bare["vs_bare"] == {}


def test_another_checkouts_bare_engine_is_compared_without_serving_goals() -> None:
    args = so.parse_args(["--bare-also", f"base={REPO_ROOT}", "--streams", "2"])
    assert args.bare_also == [("base", REPO_ROOT)] and args.served == [("this", REPO_ROOT)]
    runs = {
        "bare": so.PathRun([_result(0, [0.1, 0.2], 2, "t")], 1.0, {"bare": 0.5}),
        "base": so.PathRun([_result(0, [0.1, 0.2], 2, "t")], 2.5, {"bare": 1.2}),
        "this": so.PathRun([_result(0, [0.2, 0.4], 2, "t")], 2.0, {}),
    }
    report = so.build_report(args, runs, {})
    assert report["bare_roots"] == {"bare": str(REPO_ROOT), "base": str(REPO_ROOT)}
    assert report["vs_bare"]["base"]["ratios"]["tokens_per_s"] == pytest.approx(0.4)
    assert report["vs_bare"]["base"]["goals"] is None  # an engine, not the served path
    assert report["vs_bare"]["this"]["goals"]["throughput_ge_90pct"] is False
    assert so.parse_args(["--no-served", "--bare-also", f"base={REPO_ROOT}"]).served == []


def test_served_preset_has_one_replica_and_the_overrides(tmp_path: pathlib.Path) -> None:
    import yaml

    args = so.parse_args(["--set", "serving.stream_interval_s=0.25", "--set", "engine.page_size=8"])
    assert args.set == [("serving", "stream_interval_s", 0.25), ("engine", "page_size", 8)]
    path = so.served_preset("configs/demo.yaml", tmp_path, args.set)
    raw = yaml.safe_load(path.read_text())
    assert raw["serving"]["num_replicas"] == 1
    assert raw["serving"]["stream_interval_s"] == 0.25 and raw["engine"]["page_size"] == 8
    assert raw["model"]["demo"] == {"seed": 1234}
    with pytest.raises(ValueError, match="stream_interval_s"):  # validated before any start
        so.served_preset("configs/demo.yaml", tmp_path, [("serving", "stream_interval_s", -1)])


# -- CPU accounting ---------------------------------------------------------------------------


def test_stat_line_parsing() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    # comm may hold spaces and parentheses; session is field 6, utime/stime 14/15
    line = f"42 (ray::Serve (x) y) S 1 42 777 0 -1 0 0 0 0 0 {3 * ticks} {ticks} 0 0 20 0 1 0"
    assert parse_stat(line) == (777, 4.0)


def test_process_labels() -> None:
    assert (
        process_label(b"ray::ServeReplica:bench:LLMServer\0") == "ray::ServeReplica:bench:LLMServer"
    )
    assert process_label(b"ray::ProxyActor extra words\0") == "ray::ProxyActor"
    assert (
        process_label(b"/usr/bin/python3.11\0/x/app_process.py\0--config\0c\0") == "app_process.py"
    )
    assert process_label(b"/opt/ray/gcs_server\0--flag\0") == "gcs_server"
    assert process_label(b"") == "?"


def test_cpu_of_this_session_grows_and_differences_are_per_label() -> None:
    session = os.getsid(0)
    before = session_cpu(session)
    assert before and all(v >= 0 for v in before.values())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # burn a little CPU in this process
        pass
    after = session_cpu(session)
    assert sum(after.values()) >= sum(before.values())
    assert cpu_used({"a": 1.0, "b": 2.0}, {"a": 1.5, "c": 0.25}) == {"a": 0.5, "b": 0.0, "c": 0.25}
    assert session_cpu(-12345) == {}


# -- the client keeps choice 0's text ---------------------------------------------------------


def test_leftovers_of_an_exited_child_are_stopped() -> None:
    """A child in a session of its own starts a grandchild in its group and exits (as the app
    child's Ray agents outlive it): stop_leftovers ends the grandchild, and an empty group is
    a no-op."""
    import subprocess

    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; subprocess.Popen(['sleep', '60'])"],
        start_new_session=True,
    )
    child.wait(30)
    assert group_alive(child.pid)  # the orphaned sleep
    stop_leftovers(child.pid, grace_s=10)
    assert not group_alive(child.pid)
    stop_leftovers(child.pid)  # nothing left: no error


def test_client_collects_the_streamed_text() -> None:
    requests = so.workload(so.parse_args(["--streams", "1", "--max-tokens", "3"]))

    async def go() -> RequestResult:
        server = TestServer(FakeServer().app, host="127.0.0.1")
        await server.start_server()
        try:
            base = str(server.make_url("")).rstrip("/")
            body = {**requests[0].body, "prompt": "mode:ok"}
            request = type(requests[0])(0, "completion", requests[0].path, body)
            async with aiohttp.ClientSession() as session:
                return await run_request(session, base, request, 10.0, 0.0)
        finally:
            await server.close()

    result = asyncio.run(go())
    assert result.outcome == "ok" and len(result.chunk_s) == 3
    assert result.text == "t0 t1 t2 "
