"""Slot-strip charts: HTML cells, exact PNG size, terminal rows, the CLI hooks."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import struct
import time
from html.parser import HTMLParser

import pytest

from slotserve.commands.simulate import add_simulate_parser
from slotserve.commands.timeline import add_timeline_parser
from slotserve.lab.simulate import SEED_TOY, simulate
from slotserve.lab.timeline import (
    build_grid,
    describe,
    gantt,
    render_html,
    render_png,
    render_terminal,
)

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def static():
    return simulate(SEED_TOY, 3, "static")


@pytest.fixture(scope="module")
def continuous():
    return simulate(SEED_TOY, 3, "continuous")


def engine_trace(num_iterations: int, num_slots: int, period: int = 50) -> dict:
    """A synthetic engine trace: each slot runs requests of `period` iterations each
    (2 prefill, one stalled, the rest decode) with one idle iteration between them."""
    requests: dict[str, dict] = {}
    iterations = []
    for t in range(num_iterations):
        slots = []
        for s in range(num_slots):
            phase = (t + 7 * s) % period
            if phase == period - 1:
                slots.append(None)
                continue
            rid = f"req-{s}-{(t + 7 * s) // period}"
            record = requests.setdefault(rid, {
                "id": rid, "arrival": 0.02 * t, "arrival_iteration": max(0, t - 3),
                "prompt_tokens": 100, "output_tokens": period - 3, "first_iteration": t,
                "finish_iteration": None, "finish_reason": None})
            record["finish_iteration"] = t
            kind = "prefill" if phase < 2 else "stalled" if phase == 20 else "decode"
            slots.append({"request": rid, "kind": kind, "tokens": 1})
        iterations.append({"index": t, "start": 0.02 * t, "end": 0.02 * t + 0.019,
                           "slots": slots, "num_waiting": 0, "kv_blocks_used": 10,
                           "preempted": []})
    return {"version": 1, "source": "engine", "policy": "continuous",
            "num_slots": num_slots, "kv_blocks_total": 512,
            "requests": list(requests.values()), "iterations": iterations}


class _Cells(HTMLParser):
    """Collects the attributes of every element with class "cell"."""

    def __init__(self):
        super().__init__()
        self.cells: list[dict] = []
        self.external: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "cell" in (attrs.get("class") or "").split():
            self.cells.append({"tag": tag, **attrs})
        for key in ("src", "href"):
            if attrs.get(key):
                self.external.append(attrs[key])

    handle_startendtag = handle_starttag


def parse_cells(page: str) -> _Cells:
    parser = _Cells()
    parser.feed(page)
    return parser


# ---------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------


def test_html_has_one_rect_per_slot_iteration(static):
    parsed = parse_cells(render_html(static))
    assert len(parsed.cells) == 3 * 12
    assert {c["tag"] for c in parsed.cells} == {"rect"}
    assert {(int(c["data-slot"]), int(c["data-iteration"])) for c in parsed.cells} == {
        (s, t) for s in range(3) for t in range(12)}
    assert parsed.external == []  # self-contained


def test_html_cells_match_the_trace_and_idle_is_marked(static):
    parsed = parse_cells(render_html(static))
    by_position = {(int(c["data-slot"]), int(c["data-iteration"])): c for c in parsed.cells}
    for it in static["iterations"]:
        for s, cell in enumerate(it["slots"]):
            got = by_position[(s, it["index"])]
            if cell is None:
                assert (got["data-request"], got["data-kind"]) == ("", "idle")
            else:
                assert (got["data-request"], got["data-kind"]) == (cell["request"], "decode")
    assert sum(c["data-kind"] == "idle" for c in parsed.cells) == 36 - 22


def test_html_compare_puts_both_traces_on_the_page(static, continuous):
    page = render_html(static, compare=continuous)
    assert len(parse_cells(page).cells) == 3 * 12 + 3 * 8
    assert len(re.findall(r'class="cell"', page)) == 60
    assert "static batching" in page and "continuous batching" in page
    assert "61%" in page and "92%" in page


def test_html_request_keeps_its_color_across_a_comparison(static, continuous):
    cells = parse_cells(render_html(static, compare=continuous)).cells
    fills = {}
    for c in cells:
        if c["data-kind"] == "decode":
            fills.setdefault(c["data-request"], set()).add(c["fill"])
    assert all(len(f) == 1 for f in fills.values())
    assert len({f.pop() for f in fills.values()}) == 6  # six requests, six colors


def test_html_window(continuous):
    cells = parse_cells(render_html(continuous, start=2, end=6)).cells
    assert len(cells) == 3 * 4
    assert {int(c["data-iteration"]) for c in cells} == {2, 3, 4, 5}


def test_html_shows_prefill_stalled_and_the_gantt():
    trace = engine_trace(60, 4)
    page = render_html(trace)
    kinds = {c["data-kind"] for c in parse_cells(page).cells}
    assert kinds == {"prefill", "decode", "stalled", "idle"}
    assert 'class="span"' in page and 'data-kind="waiting"' in page  # Gantt
    assert 'class="utilline"' in page


def test_gantt_rows_wait_then_run(static):
    grid = build_grid(static)
    numbers, codes = gantt(grid)
    assert [grid.ids[n] for n in numbers] == ["R1", "R2", "R3", "R4", "R5", "R6"]
    # R4: waits 0..7 (code 4), decodes 8..11 (code 2)
    assert codes[3].tolist() == [4] * 8 + [2] * 4
    # R1: decodes 0..1, then is gone (code 0)
    assert codes[0].tolist() == [2, 2] + [0] * 10


def test_html_is_fast_on_a_long_engine_trace():
    trace = engine_trace(5000, 64)
    t0 = time.perf_counter()
    page = render_html(trace)
    elapsed = time.perf_counter() - t0
    assert len(re.findall(r'class="cell"', page)) == 5000 * 64
    assert elapsed < 10, f"render_html took {elapsed:.1f} s"


def test_bad_trace_is_rejected(static):
    broken = dict(static, iterations=[dict(static["iterations"][0], slots=[None])])
    with pytest.raises(ValueError, match="slots"):
        render_html(broken)
    with pytest.raises(ValueError, match="version"):
        render_html(dict(static, version=2))


# ---------------------------------------------------------------------------------------
# PNG
# ---------------------------------------------------------------------------------------


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("size", [(640, 360), (777, 333), (29, 41)])
def test_png_has_the_exact_requested_size(tmp_path, static, size):
    path = tmp_path / "chart.png"
    render_png(static, str(path), width_px=size[0], height_px=size[1])
    assert png_size(path) == size


def test_png_compare_and_engine_trace(tmp_path, static, continuous):
    path = tmp_path / "both.png"
    render_png(static, str(path), 1001, 555, compare=continuous)
    assert png_size(path) == (1001, 555)
    path = tmp_path / "engine.png"
    render_png(engine_trace(500, 8), str(path), 800, 600)
    assert png_size(path) == (800, 600)


def test_png_image_reads_back(tmp_path, continuous):
    import matplotlib.image

    path = tmp_path / "c.png"
    render_png(continuous, str(path), 320, 240)
    assert matplotlib.image.imread(str(path)).shape[:2] == (240, 320)


# ---------------------------------------------------------------------------------------
# Terminal
# ---------------------------------------------------------------------------------------


def slot_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("slot ")]


def test_terminal_one_row_per_slot_one_char_per_iteration(static):
    rows = slot_rows(render_terminal(static, color=False))
    assert len(rows) == 3
    inner = [row.split("│")[1] for row in rows]
    assert inner == ["AA······DDDD", "BBBBBBBBEEE·", "CCC·····FF··"]
    assert all(len(row) == len(rows[0]) == row.index("│") + 12 + 2 for row in rows)


def test_terminal_continuous_and_legend(continuous):
    text = render_terminal(continuous, color=False)
    assert [row.split("│")[1] for row in slot_rows(text)] == ["AADDDDFF", "BBBBBBBB",
                                                              "CCCEEE··"]
    assert "A=R1" in text and "F=R6" in text
    assert "92%" in text and "22/24" in text


def test_terminal_color_is_the_same_text_plus_ansi(static):
    colored = render_terminal(static, color=True)
    assert "\x1b[" in colored
    assert ANSI.sub("", colored) == render_terminal(static, color=False)
    assert "\x1b[" not in render_terminal(static, color=False)


def test_terminal_prefill_stalled_window_and_gantt():
    trace = engine_trace(60, 4)
    text = render_terminal(trace, color=False, start=10, end=40, gantt_rows=True)
    rows = slot_rows(text)
    assert len(rows) == 4 and all(len(r.split("│")[1]) == 30 for r in rows)
    strip = "".join(r.split("│")[1] for r in rows)
    assert "!" in strip and any(ch.islower() for ch in strip) and "·" in strip
    assert "iterations 10–39 of 60" in text
    assert any(line.startswith("req-") and "-" in line.split("│")[1]
               for line in text.splitlines())


# ---------------------------------------------------------------------------------------
# CLI hooks
# ---------------------------------------------------------------------------------------


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="slotserve")
    sub = parser.add_subparsers(required=True)
    add_simulate_parser(sub)
    add_timeline_parser(sub)
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_cli_simulate_default_is_the_seed_toy(tmp_path, capsys):
    out, page, image = tmp_path / "trace.json", tmp_path / "c.html", tmp_path / "c.png"
    assert run_cli("simulate", "--no-color", "--out", str(out), "--html", str(page),
                   "--png", str(image), "--png-size", "600x400") == 0
    text = capsys.readouterr().out
    assert "static: 12 iterations, utilisation 61% (22/36)" in text
    assert "continuous: 8 iterations, utilisation 92% (22/24)" in text
    assert re.search(r"R6\s+0\s+6\s+6\s+7", text)  # continuous: wait 6, first 6, finish 7
    assert len(slot_rows(text)) == 6 and "\x1b[" not in text
    saved = json.loads((tmp_path / "trace.static.json").read_text())
    assert saved == simulate(SEED_TOY, 3, "static")
    assert (tmp_path / "trace.continuous.json").exists()
    assert len(parse_cells(page.read_text()).cells) == 60
    assert png_size(image) == (600, 400)


def test_cli_simulate_lengths_arrivals_and_policy(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert run_cli("simulate", "--no-color", "--batching", "continuous", "--slots", "2",
                   "--lengths", "3,1,2", "--arrivals", "0,0,5", "--prefill-iterations", "1",
                   "--out", str(out)) == 0
    trace = json.loads(out.read_text())
    assert trace["policy"] == "continuous" and trace["num_slots"] == 2
    assert [r["output_tokens"] for r in trace["requests"]] == [3, 1, 2]
    assert trace["requests"][2]["first_iteration"] == 5


def test_cli_simulate_requests_file(tmp_path, capsys):
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text('{"id": "a", "output_tokens": 2, "arrival_iteration": 0}\n\n'
                     '{"id": "b", "output_tokens": 1, "arrival_iteration": 1}\n')
    assert run_cli("simulate", "--no-color", "--slots", "1", "--batching", "static",
                   "--requests", str(jsonl)) == 0
    assert "static: 3 iterations, utilisation 100% (3/3)" in capsys.readouterr().out


def test_cli_simulate_bad_input_is_exit_code_2(tmp_path, capsys):
    assert run_cli("simulate", "--slots", "0") == 2
    assert "num_slots" in capsys.readouterr().err
    assert run_cli("simulate", "--lengths", "1,2", "--arrivals", "0") == 2
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"id": "a", "output_tokens": 0}\n')
    assert run_cli("simulate", "--requests", str(jsonl)) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_cli_timeline_draws_a_trace_file(tmp_path, capsys, static, continuous):
    path, other = tmp_path / "s.json", tmp_path / "c.json"
    path.write_text(json.dumps(static))
    other.write_text(json.dumps(continuous))
    page, image = tmp_path / "t.html", tmp_path / "t.png"
    assert run_cli("timeline", str(path), "--no-color", "--html", str(page), "--png",
                   str(image), "--png-size", "500x300", "--start", "2", "--end", "10") == 0
    assert len(slot_rows(capsys.readouterr().out)) == 3
    assert len(parse_cells(page.read_text()).cells) == 3 * 8
    assert png_size(image) == (500, 300)
    assert run_cli("timeline", str(path), "--compare", str(other), "--html", str(page)) == 0
    assert len(parse_cells(page.read_text()).cells) == 60


def test_cli_timeline_windows_long_traces_in_the_terminal(tmp_path, capsys):
    path = tmp_path / "e.json"
    path.write_text(json.dumps(engine_trace(300, 2)))
    assert run_cli("timeline", str(path), "--no-color") == 0
    text = capsys.readouterr().out
    assert all(len(r.split("│")[1]) == 120 for r in slot_rows(text))
    assert "--start/--end" in text


class _FakeTerminal(io.StringIO):
    """A captured stdout that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def printed_by(*argv: str, stdout: io.StringIO | None = None) -> str:
    """What the command prints to `stdout` (a captured, non-terminal stream by default)."""
    stdout = stdout if stdout is not None else io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert run_cli(*argv) == 0
    return stdout.getvalue()


@pytest.fixture
def trace_file(tmp_path, static):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(static))
    return str(path)


@pytest.mark.parametrize("command", ["simulate", "timeline"])
def test_cli_colors_only_a_terminal_unless_forced(command, trace_file, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    argv = ("simulate",) if command == "simulate" else ("timeline", trace_file)
    piped = printed_by(*argv)
    assert "\x1b[" not in piped and len(slot_rows(piped)) >= 3
    forced = printed_by(*argv, "--color")
    assert "\x1b[" in forced and ANSI.sub("", forced) == piped
    assert "\x1b[" in printed_by(*argv, stdout=_FakeTerminal())
    assert "\x1b[" not in printed_by(*argv, "--no-color", stdout=_FakeTerminal())
    assert "\x1b[" not in printed_by(*argv, "--color", "--no-color")  # the last one wins


@pytest.mark.parametrize("command", ["simulate", "timeline"])
def test_cli_no_color_env_turns_the_terminal_plain_but_not_a_flag(command, trace_file,
                                                                    monkeypatch):
    argv = ("simulate",) if command == "simulate" else ("timeline", trace_file)
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[" not in printed_by(*argv, stdout=_FakeTerminal())
    assert "\x1b[" in printed_by(*argv, "--color")
    monkeypatch.setenv("NO_COLOR", "")  # no-color.org: an empty value does not count
    assert "\x1b[" in printed_by(*argv, stdout=_FakeTerminal())


def test_cli_timeline_bad_file_is_exit_code_2(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text('{"version": 1}')
    assert run_cli("timeline", str(path)) == 2
    assert "error" in capsys.readouterr().err


def test_skipped_prefill_is_marked(tiny_llama):
    """An engine trace with a prefix-cache hit: the description counts the skipped prompt
    tokens and the HTML Gantt marks the request's first iteration."""
    from slotserve.sampling import SamplingParams
    from tests.conftest import tiny_engine

    engine = tiny_engine(tiny_llama, num_blocks=32, max_num_seqs=2, block_size=4)
    shared = list(range(10, 22))
    for request_id, tail in (("first", 30), ("again", 31)):
        engine.add_request(request_id, shared + [tail],
                           SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    trace = json.loads(json.dumps(engine.export_trace()))
    assert "prefill skipped: 12/26 prompt tokens from the prefix cache (1 requests)" in \
        describe(build_grid(trace))
    page = render_html(trace)
    marks = re.findall(r'class="cached"[^>]*data-cached-tokens="(\d+)"', page)
    assert marks == ["12"]
    assert "prefill skipped" not in describe(build_grid(engine_trace(10, 2)))
