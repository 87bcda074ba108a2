"""benchmarks/host_overhead.py's summary: medians over rounds, the server beside process."""

from __future__ import annotations

from benchmarks.host_overhead import SERVER_FIGURES, summarise, with_in_process


def engine_row(batch: int, wall: float, forward: float) -> dict:
    return {"batch": batch, "wall_ms": wall, "forward_ms": forward,
            "host_ms": wall - forward, "host_us_per_seq": 1e3 * (wall - forward) / batch}


def server_row(gap: float, step: float) -> dict:
    return {"client_gap_ms": gap, "client_gap_mean_ms": gap, "engine_step_ms": step,
            "server_overhead_ms": gap - step, "loop_cpu_ms_per_token": 0.1,
            "engine_cpu_ms_per_token": step}


def test_summary_takes_each_figures_median_over_rounds() -> None:
    rounds = []
    for wall, gap in ((1.0, 2.0), (3.0, 9.0), (2.0, 4.0)):
        engine = [engine_row(1, wall, 0.5), engine_row(8, 4 * wall, 1.0)]
        rounds.append({"engine": engine, "server": with_in_process(server_row(gap, 1.5),
                                                                   engine)})
    summary = summarise(rounds)
    by_batch = {r["batch"]: r for r in summary["engine"]}
    assert by_batch[1]["wall_ms"] == 2.0 and by_batch[1]["host_ms"] == 1.5
    assert by_batch[8]["host_us_per_seq"] == 1e3 * 7.0 / 8
    assert summary["server"]["client_gap_ms"] == 4.0
    assert summary["server"]["in_process_step_ms"] == 2.0
    assert summary["server"]["client_gap_over_in_process"] == 2.0  # 2/1, 3, 2: median 2
    assert set(summary["server"]) == set(SERVER_FIGURES)


def test_without_batch_one_the_server_has_no_in_process_figures() -> None:
    server = with_in_process(server_row(2.0, 1.0), [engine_row(8, 4.0, 1.0)])
    assert "in_process_step_ms" not in server
    summary = summarise([{"engine": [engine_row(8, 4.0, 1.0)], "server": server}])
    assert "client_gap_over_in_process" not in summary["server"]
    assert summary["server"]["server_overhead_ms"] == 1.0
