"""benchmarks/quant.py's pure parts: workload scaling, file naming, the targets and tables;
and benchmarks/peers/quant_files.py's random Llama shapes (and a tiny one written and loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import quant
from benchmarks.peers import quant_files as qf
from benchmarks.perf import workload_w


def _requests(w):
    return [(r.id, r.max_tokens, r.messages, r.arrival) for r in w.requests]


def test_small_scale_is_vs_vllms_w():
    """The small files run benchmarks.vs_vllm's W exactly (at t=0 and at 2 and 4 req/s)."""
    small = quant.SCALES["small"]
    assert _requests(quant.workload("W", small)) == _requests(workload_w())
    assert _requests(quant.workload("W online low", small)) == _requests(workload_w(2.0))
    assert _requests(quant.workload("W online high", small)) == _requests(workload_w(4.0))
    batch1 = quant.workload("batch-1", small)
    assert len(batch1.requests) == 1 and batch1.requests[0].max_tokens == 128


def test_larger_models_get_smaller_workloads():
    """Each larger size class asks for fewer output tokens and lower rates, within its clip."""
    totals = [quant.workload("W", quant.SCALES[s]).total_max_tokens for s in ("small", "1b", "3b")]
    assert totals[0] > totals[1] > totals[2] > 0
    for name in ("1b", "3b"):
        scale = quant.SCALES[name]
        w = quant.workload("W", scale)
        assert len(w.requests) == scale.requests
        assert all(scale.output_min <= r.max_tokens <= scale.output_max for r in w.requests)
        assert all(r.arrival == 0 for r in w.requests)
        online = quant.workload("W online high", scale)
        # Poisson at the scaled rate: the span is about requests / rate
        assert 0.3 < online.span * scale.rates[1] / scale.requests < 3
    assert quant.workload_label("W online low", quant.SCALES["1b"]).endswith("0.5/s")


def test_unknown_workload_is_refused():
    with pytest.raises(KeyError):
        quant.workload("W 8/s", quant.SCALES["small"])
    with pytest.raises(SystemExit):
        quant.parse_args(["--workloads", "W,W 8/s"])
    with pytest.raises(SystemExit):
        quant.parse_args(["--sizes", "7b"])


def test_file_keys_and_paths(tmp_path):
    keys = qf.all_keys(("1b",))
    assert keys == ["smollm2-q8_0", "smollm2-q4_0", "smollm2-q4_k_m", "smollm2-q5_k_m",
                    "smollm2-q6_k", "gemma3-270m-q4_k_m", "llama-1b-q4_k_m"]
    gemma = tmp_path / "gemma.gguf"
    files = qf.planned_files(tmp_path, keys, gemma)
    assert [f.path.name for f in files] == [
        "smollm2-135m-q8_0.gguf", "smollm2-135m-q4_0.gguf", "smollm2-135m-q4_k_m.gguf",
        "smollm2-135m-q5_k_m.gguf", "smollm2-135m-q6_k.gguf",
        "gemma-3-270m-q4_k_m-chat-template.gguf",
        "llama-3.2-1b-shaped-random-q4_k_m.gguf"]
    assert [f.size_class for f in files] == ["small"] * 6 + ["1b"]
    assert [f.quality for f in files] == [True] * 6 + [False]  # random weights: no agreement
    assert files[2].label == "SmolLM2-135M Q4_K_M"
    assert quant.parse_args([]).files == qf.all_keys(("1b",))  # the default run: no 3B
    assert quant.parse_args(["--sizes", "1b,3b"]).files[-1] == "llama-3b-q4_k_m"


def test_unknown_file_or_missing_gemma_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown file 'smollm2-q3_k'"):
        qf.planned_files(tmp_path, ["smollm2-q3_k"], None)
    with pytest.raises(ValueError, match="make models"):
        qf.planned_files(tmp_path, [qf.GEMMA_KEY], None)


def test_llama_shapes_have_meta_parameter_counts():
    """Llama 3.2 1B: 1.24B parameters; 3B: 3.21B (tied embeddings, as Meta's cards)."""
    assert qf.parameter_count(qf.LLAMA_SHAPES["1b"]) == pytest.approx(1.236e9, rel=2e-3)
    assert qf.parameter_count(qf.LLAMA_SHAPES["3b"]) == pytest.approx(3.213e9, rel=2e-3)
    # 0.5B: Qwen2.5-0.5B's 0.36B non-embedding parameters, with Llama 3's vocabulary
    assert qf.parameter_count(qf.LLAMA_SHAPES["0.5b"]) == pytest.approx(0.473e9, rel=2e-3)
    shapes = qf.llama_tensor_shapes(qf.LLAMA_SHAPES["1b"])
    assert shapes["blk.15.attn_k.weight"] == (512, 2048)  # 8 KV heads x 64
    assert shapes["rope_freqs.weight"] == (32,) and "output.weight" not in shapes


@pytest.mark.skipif(not qf.VOCAB_GGUF.exists(), reason="llama.cpp's sources not unpacked")
def test_tiny_random_llama_loads_with_the_llama3_tokenizer(tmp_path):
    from slotserve.loader import load_model

    shape = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128)
    path = tmp_path / "tiny.gguf"
    qf.write_random_llama(path, shape, qf.VOCAB_GGUF)
    loaded = load_model(str(path), use_cache=False)
    assert loaded.config.vocab_size == qf.LLAMA_VOCAB and loaded.config.tie_word_embeddings
    assert loaded.config.rope_scaling.freq_factors[-1] == 32.0  # llama3 scaling's low band
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user")
    assert 128009 in loaded.config.eos_token_ids  # <|eot_id|>


def _row(b1_ms, w_tok_s, rss):
    return {"peak_rss_mib": rss, "start_s": 1.0, "W": {"output_tok_s": w_tok_s},
            "batch-1": {"tpot_p50_ms": b1_ms}}


def test_targets_met_and_not_met():
    ours, theirs = _row(20.0, 150.0, 1200.0), _row(25.0, 100.0, 1000.0)
    t = quant.target_figures(ours, theirs, {"slotserve": 0.97, "llama.cpp": 0.98})
    assert t["batch-1 tok/s"]["ratio"] == pytest.approx(1.25) and t["batch-1 tok/s"]["met"]
    assert t["W tok/s"]["ratio"] == pytest.approx(1.5) and t["W tok/s"]["met"]  # the bar
    assert t["peak RSS"]["met"]  # exactly llama.cpp's + 20%
    assert t["agreement"]["met"] is False
    t = quant.target_figures(_row(26.0, 149.0, 1201.0), theirs, {})
    assert not t["batch-1 tok/s"]["met"] and not t["W tok/s"]["met"]
    assert not t["peak RSS"]["met"]
    assert t["agreement"] == {"slotserve": None, "llama.cpp": None, "ratio": None,
                              "bar": ">= x1.0", "met": None}
    assert quant.target_figures({}, theirs, {})["W tok/s"]["met"] is None  # slotserve failed


def test_summary_medians_and_tables():
    def run(start, rss, tok_s, tpot):
        stats = {"p50": tpot, "p99": 2 * tpot}
        result = {"output_throughput": tok_s, "ttft_ms": stats, "tpot_ms": stats, "failed": 0}
        return {"start_s": start, "peak_rss_mib": rss,
                "results": {"W": result, "batch-1": result}}

    row = quant.summarize([run(1, 100, 10, 5), run(3, 300, 30, 7), run(2, 200, 20, 6)])
    assert (row["start_s"], row["peak_rss_mib"], row["rounds"]) == (2, 200, 3)
    assert row["W"]["output_tok_s"] == 20 and row["batch-1"]["tpot_p99_ms"] == 12
    assert "W online low" not in row
    theirs = dict(row, peak_rss_mib=100)
    report = {"files": [{
        "label": "SmolLM2-135M Q8_0", "size_mib": 138.4, "errors": {},
        "summary": {"slotserve": row, "llama.cpp": theirs},
        "quality": {"slotserve": 0.99, "llama.cpp": 0.985},
        "targets": quant.target_figures(row, theirs, {"slotserve": 0.99, "llama.cpp": 0.985})}]}
    speed = quant.speed_table(report)
    assert "| SmolLM2-135M Q8_0 | 138 | slotserve | 200 | 2.0 | 20 | 6 / 12 |" in speed
    assert "99.0%" in speed and "98.5%" in speed
    targets = quant.targets_table(report)
    assert "x2.00 **not met**" in targets  # RSS twice llama.cpp's
    assert "x1.00 met" in targets  # batch-1 as fast
    assert "x1.00 **not met**" in targets  # W as fast: the bar is x1.5
    assert "x1.01 met" in targets  # agreement
    assert "peak RSS: slotserve / llama.cpp <= x1.2" in targets


def test_agreement_and_rotation():
    assert quant.agreement([[True, False], [True, True]]) == 0.75
    with pytest.raises(ValueError):
        quant.agreement([[], []])
    assert quant.rotated(("a", "b"), 0) == ["a", "b"]
    assert quant.rotated(("a", "b"), 1) == ["b", "a"]
    assert quant.rotated(("a", "b"), 2) == ["a", "b"]


def test_paired_agreement_counts_the_positions_one_system_got():
    """Four positions: both hit one, only ours two, only theirs one; the standard error by
    position is sqrt(b + c - (b - c)^2 / n) / n, the spread of the per-position differences;
    by prompt, sqrt(J / (J - 1) * sum_j (D_j - d n_j)^2) / n: D = (1, 0), d = 1/4, n_j = 2."""
    ours = [[True, True], [True, False]]
    theirs = [[True, False], [False, True]]
    paired = quant.paired_agreement(ours, theirs)
    assert (paired["positions"], paired["only_slotserve"], paired["only_llama.cpp"]) == (4, 2, 1)
    assert paired["difference"] == pytest.approx(0.25)
    assert paired["difference"] == pytest.approx(quant.agreement(ours) - quant.agreement(theirs))
    assert paired["standard_error"] == pytest.approx((3 - 1 / 4) ** 0.5 / 4)
    assert paired["prompt_standard_error"] == pytest.approx((2 * (0.5**2 + 0.5**2)) ** 0.5 / 4)
    same = quant.paired_agreement(ours, ours)
    assert same["standard_error"] == 0.0 and same["prompt_standard_error"] == 0.0
    assert quant.paired_agreement([[True]], [[False]])["prompt_standard_error"] is None
    assert quant.hits_text(ours) == ["11", "10"]
    with pytest.raises(ValueError):  # not the same positions
        quant.paired_agreement(ours, [[True, True]])
    with pytest.raises(ValueError):
        quant.paired_agreement([[True]], [[True, False]])
    line = quant.paired_lines({"files": [{"label": "f", "quality_paired": paired}]})
    assert line == ["f: agreement slotserve - llama.cpp +25.00% (standard error 25.00% by "
                    "prompt, 41.46% by position; positions only slotserve got 2, only "
                    "llama.cpp 1, of 4)"]
    # one system failed on the file: nothing to pair
    assert quant.quality_paired({"slotserve": ours}) is None
    assert quant.quality_paired({"slotserve": ours, "llama.cpp": theirs}) == paired


def test_quality_only_run_and_prompt_count():
    args = quant.parse_args(["--workloads", "", "--quality-prompts", "96", "--rounds", "3"])
    assert args.workloads == [] and args.quality_prompts == 96
    assert args.rounds == 1  # quality is measured in round 1 only
    with pytest.raises(SystemExit):
        quant.parse_args(["--quality-prompts", "0"])
    with pytest.raises(SystemExit):  # nothing to measure
        quant.parse_args(["--workloads", "", "--no-quality"])


def test_a_quality_only_run_has_no_memory_target():
    """Without workloads the servers' peak RSS is idle servers': no target is judged on it."""
    idle = {"rounds": 1, "start_s": 1.0, "peak_rss_mib": 400}
    figures = quant.target_figures(idle, dict(idle, peak_rss_mib=900),
                                   {"slotserve": 0.98, "llama.cpp": 0.97})
    assert figures["peak RSS"]["met"] is None
    assert figures["agreement"]["met"] is True


def test_both_servers_get_the_same_context():
    """slotserve's KV pool holds what llama.cpp's -c gives its 64 slots, 512 positions each."""
    flags = quant.slotserve_flags(Path("/m.gguf"))
    assert {"--model=/m.gguf", "--quantization=gguf", "--max-num-seqs=64",
            "--max-model-len=512", "--num-blocks=2048", "--block-size=16"} <= set(flags)
    cmd = quant.llama_server("llama-server", "/m.gguf", quant.SLOTS, quant.LLAMA_THREADS,
                             ctx_per_slot=quant.CTX_PER_SLOT).cmd
    assert cmd[cmd.index("-c") + 1] == "32768" and cmd[cmd.index("--parallel") + 1] == "64"
    assert cmd[cmd.index("--threads") + 1] == "2"


def test_chat_template_copy_keeps_the_tensors(tmp_path):
    """Gemma's base-model file gets Gemma 3's template in a copy; its tensors are unchanged."""
    import gguf
    import numpy as np

    src, dst = tmp_path / "base.gguf", tmp_path / "chat.gguf"
    writer = gguf.GGUFWriter(str(src), "gemma3")
    weights = np.arange(64, dtype=np.float32).reshape(2, 32)
    writer.add_tensor("token_embd.weight", weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    qf.with_chat_template(src, dst, qf.GEMMA3_TEMPLATE)
    copy = gguf.GGUFReader(str(dst))
    template = copy.fields["tokenizer.chat_template"].contents()
    assert template == qf.GEMMA3_TEMPLATE.read_text() and "<start_of_turn>" in template
    assert (copy.tensors[0].data == weights).all()
    assert not dst.with_suffix(".part").exists()
