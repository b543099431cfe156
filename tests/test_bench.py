"""The harness's own logic: percentiles, distributions, arrivals, SSE timing, summaries."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.bench import compare, compare_report, edge_bench, fairness, fairness_report, report, systems
from services.bench.client import Timing, read_frame
from services.bench.load import Load, Result, summarize
from services.bench.stats import Interval, Summary, percentile
from services.bench.workload import Distribution, poisson_gaps, requests


@pytest.mark.parametrize(("q", "expected"), [(0, 1.0), (50, 2.5), (90, 3.7), (99, 3.97), (100, 4.0)])
def test_percentile_interpolates_like_numpy(q: float, expected: float) -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([7.0], 99) == 7.0


def test_summary_and_scaling() -> None:
    summary = Summary.of([0.001, 0.002, 0.003]).scaled(1000)
    assert (summary.mean, summary.p50) == pytest.approx((2.0, 2.0))


@pytest.mark.parametrize(
    ("text", "low", "high"), [("fixed:16", 16, 16), ("uniform:10-20", 10, 20), ("normal:100,1", 90, 110)]
)
def test_distributions_draw_in_range(text: str, low: int, high: int) -> None:
    rng = random.Random(0)
    draws = [Distribution.parse(text).draw(rng) for _ in range(200)]
    assert low <= min(draws) and max(draws) <= high


@pytest.mark.parametrize("text", ["fixed", "uniform:5", "normal:1", "zipf:2", "fixed:x"])
def test_bad_distributions_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="distribution"):
        Distribution.parse(text)


def test_requests_are_reproducible_and_sized() -> None:
    first = requests(5, Distribution("fixed", 12), Distribution("uniform", 5, 9), seed=3)
    assert first == requests(5, Distribution("fixed", 12), Distribution("uniform", 5, 9), seed=3)
    assert all(len(r.prompt.split()) == 12 and 5 <= r.max_tokens <= 9 for r in first)


def test_poisson_gaps_have_the_asked_rate() -> None:
    gaps = poisson_gaps(20.0, seed=1)
    sample = [next(gaps) for _ in range(4000)]
    assert statistics.mean(sample) == pytest.approx(1 / 20, rel=0.1)
    assert next(poisson_gaps(float("inf"), seed=1)) == 0.0


def test_chat_frames_are_timed() -> None:
    timing = Timing(start=10.0)
    read_frame("chat", b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}', timing, 10.1)
    read_frame("chat", b'{"choices":[{"index":0,"delta":{"content":"Hi"}}]}', timing, 10.3)
    read_frame("chat", b'{"choices":[{"index":0,"delta":{"content":" there"}}]}', timing, 10.4)
    read_frame("chat", b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}', timing, 10.5)
    read_frame("chat", b"[DONE]", timing, 10.6)
    timing.end = 10.6
    assert timing.ttfc == pytest.approx(0.1) and timing.ttft == pytest.approx(0.3)
    assert timing.itls == pytest.approx([0.1])
    assert (timing.output_tokens, timing.prompt_tokens) == (3, 5)
    assert timing.tpot == pytest.approx((0.6 - 0.3) / 2)


def test_completion_frames_and_errors() -> None:
    timing = Timing(start=0.0)
    read_frame("completions", b'{"choices":[{"index":0,"text":"a"}]}', timing, 0.2)
    read_frame("completions", b'{"error":{"message":"boom"}}', timing, 0.3)
    assert timing.content == [0.2]
    assert timing.error is not None and "boom" in timing.error
    assert not timing.ok


def test_summary_counts_failures_and_goodput() -> None:
    fast = Timing(start=0.0, content=[0.1, 0.2, 0.3], end=0.3, output_tokens=3)
    slow = Timing(start=0.0, content=[3.0, 3.1], end=3.1, output_tokens=2)
    failed = Timing(start=0.0, error="HTTP 500")
    result = summarize("x", Load("http://h", "m", slo_ttft_ms=1000), [fast, slow, failed], duration_s=2.0)
    assert (result.requests, result.failed) == (3, 1)
    assert result.output_throughput == pytest.approx(5 / 2.0)
    assert result.goodput == pytest.approx(1 / 2.0)
    assert result.ttft_ms.p50 == pytest.approx((100 + 3000) / 2)


def test_the_vllm_bench_summary_is_cut_out_of_its_noise() -> None:
    from services.bench.compare import result_block

    table = "============ Serving Benchmark Result ============\nSuccessful requests: 16\n" + "=" * 50
    assert result_block("warming up\n" + table + "\n 6%|| 1/16 progress\nleaked type") == table


def test_a_vllm_bench_run_whose_requests_failed_says_so(tmp_path: Path) -> None:
    summary = "============ Serving Benchmark Result ============\nSuccessful requests:   0\nFailed requests:   16\n"
    assert compare.failed_requests(summary) == 16 and compare.failed_requests("no summary") is None
    out = tmp_path / "bench.md"
    report.write(report.Report(command="test", comparison={}, hops=(), throughput=None, many=None,
                               vllm_bench=(0, summary)), out)
    assert "exit status 0. **16 of its requests failed.**" in out.read_text()


def _fairness_result() -> fairness.Result:
    def figures(tenant: str, ttft_ms: float, tokens: int, share: float) -> fairness.TenantFigures:
        return fairness.TenantFigures(tenant, 1.0, 10, 0, Summary(ttft_ms, ttft_ms, ttft_ms, ttft_ms), tokens, share)

    plan = fairness.Plan()
    runs = []
    for scheduler, flooded_ms, heavy_share in (("fifo", 2600.0, 0.5), ("fair", 80.0, 0.667)):
        runs += [fairness.ScenarioFigures(f"flood: {shape}", scheduler, 15.0, {
            "tenant-b alone": figures("tenant-b alone", 57.0, 640, 1.0),
            "tenant-b": figures("tenant-b", flooded_ms, 700, 0.015), "tenant-a": figures("tenant-a", 2600.0, 46000,
                                                                                           0.985)})
                 for shape in fairness.FLOODS]
        runs.append(fairness.ScenarioFigures("weights", scheduler, 15.0, {
            "light": figures("light", 2000.0, round(30000 * (1 - heavy_share)), 1 - heavy_share),
            "heavy": figures("heavy", 2000.0, round(30000 * heavy_share), heavy_share)}))
    return fairness.Result(plan, runs)


def test_the_fairness_section_replaces_its_own_and_keeps_the_others(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Other\n\nkept\n\n## Fair share between tenants (simulated engine)\n\nold\n")
    fairness_report.write(_fairness_result(), out, "tokenbus bench fairness")
    text = out.read_text()
    assert "kept" in text and "old" not in text and text.count("## Fair share") == 1
    assert "| fair | same length | 57 / 57 ms | 80 / 80 ms | 1.4x |" in text
    assert "| fair | long prompts | 57 / 57 ms | 80 / 80 ms | 1.4x |" in text
    assert "| fair | 9990 | 20010 | 2.00 | 66.7% |" in text
    assert (tmp_path / "bench-fairness.png").stat().st_size > 0
    report.write(report.Report(command="test", comparison={}, hops=(), throughput=None, many=None,
                               vllm_bench=None), out)  # `bench all` writes its sections anew
    text = out.read_text()
    assert "| fair | mixed lengths | 57 / 57 ms | 80 / 80 ms | 1.4x |" in text
    assert text.count("kept") == 1 and text.count(report.KEPT) == 1  # "## Other" says so; fairness names its run
    report.write(report.Report(command="test", comparison={}, hops=(), throughput=None, many=None,
                               vllm_bench=None), out)
    assert out.read_text().count(report.KEPT) == 1


def _cell(throughput: float, ttft_ms: float, cpu_s: float, vllm: bool = False, front_ttft_ms: float = 10.0
          ) -> compare.Cell:
    flat = Summary(ttft_ms, ttft_ms, ttft_ms, ttft_ms)
    step = Summary(10.0, 10.0, 10.0, 10.0)
    result = Result("x", 8, 8, 0, 1.0, 8.0, throughput, 8.0, flat, flat, step, step, flat)
    parts = {compare.API_SERVER: cpu_s} if vllm else {compare.EDGE: cpu_s * 0.4, compare.WORKER: cpu_s * 0.4,
                                                       compare.REDIS: cpu_s * 0.2}
    return compare.Cell(result, tokens=1000, front_cpu_s=cpu_s, engine_cpu_s=1.0, front_cpu_by_part=parts,
                        engine_ttft_ms=ttft_ms - front_ttft_ms)


def _comparison() -> compare.Comparison:
    shape = compare.short_shape(64, 192)
    rounds = range(6)
    # tokenbus: 20% more throughput, half the front-end CPU and 1.5x its share of TTFT in every round, the same
    # TTFT give or take noise
    return {shape: {
        compare.TOKENBUS: [_cell(120.0 + r, 50.0 + (r % 2), 0.05, front_ttft_ms=15.0) for r in rounds],
        compare.TWO_EDGES: [_cell(100.0 + r, 50.0, 0.1) for r in rounds],
        compare.VLLM_SERVE: [_cell(100.0 + r, 50.5 - (r % 2), 0.1, vllm=True) for r in rounds]}}


def test_a_comparison_writes_its_section_after_every_round_so_a_run_cut_short_leaves_its_rounds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lent GPU machine can be taken back mid-run: the section is written between rounds, saying it is
    unfinished, and the last write is the whole run's."""
    out = tmp_path / "benchmarks.md"
    measured = iter(range(1000))

    def measure(deployment: object, shape: compare.Shape, system: str, *_: object, **__: object) -> compare.Cell:
        return _cell(100.0 + next(measured), 50.0, 0.1, vllm=system == compare.VLLM_SERVE)

    monkeypatch.setattr(compare, "measure", measure)
    monkeypatch.setattr(compare, "idle_cpu", lambda deployments, seconds: {name: {"part": 1.0} for name in deployments})
    plan = compare.Plan((compare.short_shape(64, 192),), rounds=3, pause_s=0.0, idle_s=0.0)
    seen: list[str] = []

    def after_round(comparison: compare.Comparison, idle: compare.Idle, done: int, planned: int) -> None:
        assert all(len(cells) == done for by_system in comparison.values() for cells in by_system.values())
        report.write_comparison(comparison, out, "tokenbus bench compare --rounds 3", CPU_ENGINE, idle, planned)
        seen.append(out.read_text())

    deployments = dict.fromkeys(plan.systems, None)
    comparison, _ = compare._rounds(deployments, "m", plan, after_round)
    assert len(seen) == 3 and "**Unfinished**: 1 of the 3 rounds asked for." in seen[0]
    assert "then come 2 rounds" in seen[1] and "**Unfinished**: 2 of the 3" in seen[1]
    assert "Unfinished" not in seen[2] and "then come 3 rounds" in seen[2]
    assert [len(cells) for cells in comparison[plan.shapes[0]].values()] == [3, 3, 3]


def test_the_comparison_section_gives_ratios_intervals_and_verdicts(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Other\n\nkept\n\n## tokenbus against `vllm serve`\n\nstale figures\n")
    idle = {compare.TOKENBUS: [{compare.EDGE: ms - 3.0, compare.WORKER: 1.0, compare.REDIS: 2.0}
                               for ms in (4.0, 4.5, 3.5, 4.0, 4.5, 3.5)],
            compare.TWO_EDGES: [{"edge 1": 1.0, "edge 2": 1.0, compare.WORKER: 1.0, compare.REDIS: 2.0}] * 6,
            compare.VLLM_SERVE: [{compare.API_SERVER: 2.0}] * 6}
    report.write_comparison(_comparison(), out, "tokenbus bench compare", CPU_ENGINE, idle)
    text = out.read_text()
    assert "kept" in text and "stale" not in text and text.count(compare_report.HEADING) == 1
    assert "| short | 64 | vllm serve | 102.5 | 8.00 | 50 ms |" in text
    assert "| short | 64 | tokenbus | 122.5 | 8.00 | 50 ms | 50 ms | 15 ms |" in text  # TTFT p50, p99, front's share
    rows = {line.split(" | ")[2]: line for line in text.splitlines() if " / vllm serve | " in line}
    assert rows.keys() == {"tokenbus / vllm serve", "tokenbus, 2 edges / vllm serve"}
    throughput, ttft, _tpot, cpu, front_ttft = rows["tokenbus / vllm serve"].split(" | ")[3:8]
    assert throughput.startswith("1.195x [") and throughput.endswith("**lead**")
    assert ttft.endswith("level (within noise)")
    assert cpu.startswith("0.500x [0.500, 0.500] **lead**")
    assert front_ttft.startswith("1.500x [1.500, 1.500] **loss**")
    assert rows["tokenbus, 2 edges / vllm serve"].count("1.000x [1.000, 1.000] level (within noise)") == 4
    assert "| tokenbus | 4.00 ms/s | 2.000x [" in text and "| vllm serve | 2.00 ms/s |  |" in text
    assert "| tokenbus, 2 edges | 5.00 ms/s | 2.500x [2.500, 2.500] **loss** |" in text
    # the breakdown: per token by process in the shape (0.05 CPU-s over 1000 tokens: 50 us), and while idle
    assert ("| tokenbus | edge 20 + worker 20 + redis-server 10 = 50 | edge 1.00 + worker 1.00 + redis-server 2.00 "
            "= 4.00 |") in text
    assert "| vllm serve | API server 100 | API server 2.00 |" in text


CPU_ENGINE = systems.Engine("SmolLM2-135M-Instruct", Path("."))
GPU_ENGINE = systems.Engine("SmolLM2-135M-Instruct", Path("."), dtype="bfloat16", gpu="NVIDIA H200",
                            enforce_eager=False)


def test_a_comparison_made_on_a_gpu_has_its_own_section_and_a_cpu_run_keeps_it(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    report.write(report.Report(command="test", comparison={}, hops=(), throughput=None, many=None,
                               vllm_bench=None), out)
    assert report.GPU_UNMEASURED in out.read_text()  # this machine has no GPU
    report.write_comparison(_comparison(), out, "tokenbus bench compare", CPU_ENGINE)
    assert report.GPU_UNMEASURED in out.read_text()
    report.write_comparison(_comparison(), out, "tokenbus bench compare", GPU_ENGINE)
    text = out.read_text()
    assert report.GPU_UNMEASURED not in text and text.count(report.GPU_ELSEWHERE) == 1
    assert text.count(compare_report.HEADING + "\n") == 1 and text.count(compare_report.GPU_HEADING) == 1
    assert "(float32, max-model-len 2048, max-num-seqs 32, 2 GiB KV cache, eager mode)" in text
    assert ("(bfloat16, max-model-len 2048, max-num-seqs 32, 40% of the GPU's memory each, CUDA graphs, on one "
            "NVIDIA H200 that both engines share)") in text
    assert "on this machine: " in text.split(compare_report.GPU_HEADING)[1]  # the GPU machine is not the doc's
    # a later run on a machine without a GPU writes the document anew and keeps the GPU section, saying so
    report.write(report.Report(command="test", comparison={}, hops=(), throughput=None, many=None,
                               vllm_bench=None), out)
    text = out.read_text()
    assert compare_report.GPU_HEADING in text and report.GPU_UNMEASURED not in text
    assert text.count(report.GPU_ELSEWHERE) == 1


def test_the_engines_share_a_gpu_and_run_in_its_own_dtype_and_cuda_graphs_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(systems, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    on_gpu = systems.Engine.on_this_machine("m", Path("."))
    assert (on_gpu.gpu, on_gpu.dtype, on_gpu.gpu_memory_utilization, on_gpu.enforce_eager) == (
        "NVIDIA H100 80GB HBM3", "bfloat16", 0.4, False)
    # every stream of the widest shape runs in the engine at once: the front end, not the engine's cap, is measured
    widest = max(shape.concurrency for shape in compare.Plan.full(scale_out=True).shapes)
    assert on_gpu.max_num_seqs >= widest
    monkeypatch.setattr(systems, "gpu_name", lambda: None)
    on_cpu = systems.Engine.on_this_machine("m", Path("."))
    assert (on_cpu.dtype, on_cpu.enforce_eager, on_cpu.max_num_seqs) == ("float32", True, 32)


def test_the_scale_out_shape_runs_four_edges_against_two_vllm_serves_and_splits_the_gpu_three_ways() -> None:
    assert compare.Plan.full().systems == (compare.TOKENBUS, compare.TWO_EDGES, compare.VLLM_SERVE)
    assert (compare.Plan.full().edges, compare.Plan.full().engines) == (2, 2)
    plan = compare.Plan.full(scale_out=True)
    scaled = plan.shapes[-1]
    assert (scaled.name, scaled.concurrency, scaled.output_len) == ("scale-out", 256, Distribution("fixed", 16))
    assert scaled.systems == compare.SYSTEMS and (plan.edges, plan.engines) == (4, 3)
    assert all(shape.concurrency < 256 for shape in plan.shapes[:-1])
    three = dataclasses.replace(GPU_ENGINE, engines=plan.engines)
    assert three.gpu_memory_utilization == 0.27 and GPU_ENGINE.gpu_memory_utilization == 0.4


def test_every_tokenbus_variant_is_judged_against_each_vllm_serve_it_ran_beside(tmp_path: Path) -> None:
    shape = compare.scale_out_shape(256, 768)
    rounds = range(6)
    # two API servers serve 10% more than one; four edges 20% more than one API server
    by_system = {compare.TOKENBUS: [_cell(100.0 + r, 50.0, 0.1) for r in rounds],
                 compare.TWO_EDGES: [_cell(110.0 + 1.1 * r, 50.0, 0.1) for r in rounds],
                 compare.FOUR_EDGES: [_cell(120.0 + 1.2 * r, 50.0, 0.1) for r in rounds],
                 compare.VLLM_SERVE: [_cell(100.0 + r, 50.0, 0.1, vllm=True) for r in rounds],
                 compare.VLLM_SERVE_2: [_cell(110.0 + 1.1 * r, 50.0, 0.1, vllm=True) for r in rounds]}
    out = tmp_path / "benchmarks.md"
    report.write_comparison({shape: by_system}, out, "tokenbus bench compare --scale-out",
                            dataclasses.replace(GPU_ENGINE, engines=3))
    text = out.read_text()
    throughput = {line.split(" | ")[2]: line.split(" | ")[3] for line in text.splitlines() if "x [" in line}
    assert set(throughput) == {f"{ours} / {theirs}" for ours in (compare.TOKENBUS, compare.TWO_EDGES,
                                                                compare.FOUR_EDGES) for theirs in compare.BASELINES}
    assert throughput["tokenbus, 4 edges / vllm serve, 2 API servers"].startswith("1.091x [")
    assert throughput["tokenbus, 4 edges / vllm serve"].startswith("1.200x [1.200, 1.200] **lead**")
    assert throughput["tokenbus / vllm serve"].startswith("1.000x [1.000, 1.000] level")
    assert "one vLLM worker and four edges" in text and "once with `--api-server-count 2`" in text
    assert "27% of the GPU's memory each" in text and "that the 3 engines share" in text


def test_the_front_end_of_vllm_serve_is_its_server_and_the_api_servers_it_launched() -> None:
    """Real processes named as vLLM names them: `--api-server-count 2` starts two VLLM::APIServer_N children
    beside its engine core; all of the API servers are front end, the rest is the engine."""
    child = ("import sys, time\nopen('/proc/self/comm', 'w').write(sys.argv[1])\nprint(flush=True)\n"
             "time.sleep(60)")
    launcher = ("import subprocess, sys\n"
                f"names = ['VLLM::EngineCore', 'VLLM::APIServer_0', 'VLLM::APIServer_1']\n"
                f"kids = [subprocess.Popen([sys.executable, '-c', {child!r}, n], stdout=subprocess.PIPE) "
                "for n in names]\n[k.stdout.readline() for k in kids]\nprint(*[k.pid for k in kids], flush=True)\n"
                "sys.stdin.readline()\n[k.kill() for k in kids]")
    with subprocess.Popen([sys.executable, "-c", launcher], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as server:
        assert server.stdout is not None and server.stdin is not None
        engine_core, first, second = map(int, server.stdout.readline().split())
        deployment = compare.vllm_serve_deployment(systems.Running("http://x", {"server": server.pid}))
        server.stdin.write("\n")
        server.stdin.flush()
    assert deployment.front == ((compare.API_SERVER, server.pid), (f"{compare.API_SERVER} 1", first),
                                (f"{compare.API_SERVER} 2", second))
    assert deployment.engine_pids == (engine_core,)


def test_the_load_is_dealt_over_every_edge() -> None:
    shape = Load("http://a/", "m", concurrency=2, extra_base_urls=("http://b",))
    assert shape.urls == ["http://a/v1/chat/completions", "http://b/v1/chat/completions"]


def test_cpu_readings_resolve_below_a_clock_tick() -> None:
    """A few milliseconds of CPU show as such: the 10 ms ticks of /proc/<pid>/stat would read them as 0 or 10.
    The process is read while it waits, as the bench reads systems between cells."""
    script = ("import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
              "while time.process_time() - t < 0.003: pass\nprint(time.process_time() - t, flush=True)\n"
              "sys.stdin.readline()")
    with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as burner:
        assert burner.stdin is not None and burner.stdout is not None
        time.sleep(0.3)  # past its start-up, waiting for its line
        before = systems.cpu_reading(burner.pid)
        burner.stdin.write("go\n")
        burner.stdin.flush()
        burnt = float(burner.stdout.readline())
        time.sleep(0.05)  # back to waiting
        spent = systems.cpu_reading(burner.pid).seconds_since(before)
        burner.kill()
    assert burnt <= spent < burnt + 0.005


def test_a_thread_that_ended_keeps_its_time_in_the_reading() -> None:
    """A thread gone from the second reading takes its count with it: the process's ticks count it instead,
    rather than a sum over the threads left that would come out short, or negative."""
    before = systems.CpuReading({1: 5_000_000_000, 2: 1_000_000_000}, ticks_s=6.0)
    after = systems.CpuReading({1: 5_020_000_000}, ticks_s=6.03)
    assert after.seconds_since(before) == pytest.approx(0.03)
    grown = systems.CpuReading({1: 5_020_000_000, 2: 1_000_000_000, 3: 4_000_000}, ticks_s=6.03)
    assert grown.seconds_since(before) == pytest.approx(0.024)


def test_a_hop_target_is_met_or_missed_only_by_a_whole_interval(tmp_path: Path) -> None:
    flat = Summary(1.0, 1.0, 1.0, 1.0)
    overheads = edge_bench.Overheads(ttft_ms=flat, itl_ms=flat, first_wave_ttft_ms=flat)
    added = {"ttft p50": Interval(0.8, 0.6, 0.95, 6), "ttft p99": Interval(3.2, 2.5, 4.0, 6),
             "first wave p50": Interval(20.0, 15.0, 25.0, 6)}
    cpu_us = {"tokenbus": {"edge": [500.0] * 6, "worker": [300.0] * 6, "redis-server": [100.0] * 6},
              "bare": {"bare": [400.0, 380.0, 420.0, 400.0, 390.0, 410.0]}}
    hop = edge_bench.HopResult(64, 50.0, 20.0, tokenbus=overheads, bare=overheads, rounds=6, pinned=True,
                               added_ms=added, cpu_us=cpu_us)
    out = tmp_path / "bench.md"
    report.write(report.Report(command="test", comparison={}, hops=(hop,), throughput=None, many=None,
                               vllm_bench=None), out)
    text = out.read_text()
    assert "| own core | time to first token p50, steady state | < 1 ms | 0.80 ms [0.60, 0.95] (6 rounds) | **met** |" \
        in text
    assert "| < 3 ms | 3.20 ms [2.50, 4.00] (6 rounds) | undecided (within noise) |" in text
    assert "| < 10 ms | 20.00 ms [15.00, 25.00] (6 rounds) | **missed** |" in text
    # 900 us across the three processes against 400 for the bare server: 2.25x, wholly above the 1.5x target
    assert "| own core | edge 500 + worker 300 + redis-server 100 = 900 | 400 | 2.25x [" in text
    assert text.split("| 400 | 2.25x [")[1].split("\n")[0].endswith("| **missed** |")
