"""lm-evaluation-harness through the server's /v1/completions and through HF transformers, on
the embedded SmolLM2-135M-Instruct in fp32: the same tasks, the same scores.

    nice .venv/bin/python -m benchmarks.lm_eval_check --json benchmarks/results/lm-eval-check.json

Needs `lm_eval[api,hf]` (PyPI; not a dependency of slotserve: `pip install "lm_eval[api,hf]"
torch==<the installed torch>` keeps the CPU torch). No download: two small tasks over local
JSONL (benchmarks/data/), written for this check:

- `slotserve_choices` (multiple choice, 24 questions x 4 choices: loglikelihood requests,
  which lm_eval's `local-completions` sends as echo + logprobs=1 + max_tokens=1 with token
  ids, several prompts per request): acc and acc_norm;
- `slotserve_answers` (generate_until, 12 sentences to complete, greedy, until a newline,
  a period or a comma): exact_match, ignoring case and the leading space.

The HF side is lm_eval's own `HFLM` over transformers' load of the same .gguf. Compared:
each task's metrics (equal, or the run fails), every loglikelihood (largest difference, and
how many requests differ in is_greedy) and every generated answer (how many differ).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
REPO = Path(__file__).resolve().parents[1]
SERVED_NAME = "smollm2"
# fp32 on both sides; a context of 512 holds every request of these tasks
ENGINE_FLAGS = dict(quantization="none", max_model_len=512, max_num_seqs=16,
                    max_num_batched_tokens=512, num_blocks=256)
LOGLIKELIHOOD_TOLERANCE = 1e-3  # fp32 over different kernels: observed well below this


def task_configs(limit_dir: Path) -> list[dict]:
    """The two tasks as lm_eval task configs (dicts) over the JSONL files in `limit_dir`."""
    def local(name: str) -> dict:
        return {"dataset_path": "json", "dataset_kwargs": {
            "data_files": {"test": str(limit_dir / f"lm_eval_{name}.jsonl")}},
            "test_split": "test"}

    choices = {"task": "slotserve_choices", **local("choices"),
               "output_type": "multiple_choice", "doc_to_text": "{{question}}",
               "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
               "target_delimiter": "",
               "metric_list": [{"metric": "acc", "aggregation": "mean",
                                "higher_is_better": True},
                               {"metric": "acc_norm", "aggregation": "mean",
                                "higher_is_better": True}]}
    answers = {"task": "slotserve_answers", **local("answers"),
               "output_type": "generate_until",
               "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
               "generation_kwargs": {"until": ["\n", ".", ","], "max_gen_toks": 8,
                                     "do_sample": False, "temperature": 0.0},
               "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                                "higher_is_better": True, "ignore_case": True,
                                "ignore_punctuation": True}],
               "filter_list": [{"name": "strip", "filter": [{"function": "remove_whitespace"},
                                                         {"function": "take_first"}]}]}
    return [choices, answers]


def hf_model_and_tokenizer():
    """transformers' own load of the embedded .gguf, fp32, eval mode."""
    import torch
    import transformers

    from slotserve.loader import default_model_path

    path = default_model_path()
    where, name = os.path.dirname(path), os.path.basename(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)
    return model, tokenizer


def evaluate(model, tasks: list[dict], limit: int | None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=TaskManager(),
                                   limit=limit, log_samples=True, random_seed=0,
                                   numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0)


def run_hf(tasks: list[dict], limit: int | None, batch_size: int) -> tuple[dict, float]:
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = hf_model_and_tokenizer()
    start = time.monotonic()
    results = evaluate(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                            device="cpu", max_length=ENGINE_FLAGS["max_model_len"]),
                       tasks, limit)
    return results, time.monotonic() - start


def run_server(tasks: list[dict], limit: int | None, batch_size: int, workdir: Path
               ) -> tuple[dict, float, int]:
    """lm_eval's local-completions against a started `slotserve serve` (token-id requests,
    tokenized by the model's HF tokenizer, saved to `workdir`)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from slotserve.lab.bench.server import ServerProcess, cli_flags

    _, tokenizer = hf_model_and_tokenizer()
    tokenizer.save_pretrained(workdir / "tokenizer")
    server = ServerProcess.launch(workdir / "server.log", *cli_flags(**ENGINE_FLAGS),
                                  f"--served-model-name={SERVED_NAME}", cwd=REPO)
    try:
        server.wait_ready()
        model = LocalCompletionsAPI(
            base_url=server.base_url + "/completions", model=SERVED_NAME,
            tokenizer=str(workdir / "tokenizer"), tokenizer_backend="huggingface",
            tokenized_requests=True, batch_size=batch_size, num_concurrent=1, max_retries=1,
            max_length=ENGINE_FLAGS["max_model_len"])
        start = time.monotonic()
        results = evaluate(model, tasks, limit)
        seconds = time.monotonic() - start
    finally:
        code = server.stop()
    return results, seconds, code


def scores(results: dict) -> dict[str, dict[str, float]]:
    """task -> metric -> value (lm_eval's 'acc,none' keys, stderr left out)."""
    return {task: {k: float(v) for k, v in metrics.items()
                   if "stderr" not in k and isinstance(v, (int, float))}
            for task, metrics in results["results"].items()}


def compare_samples(hf: dict, served: dict) -> dict:
    """Per request: the largest loglikelihood difference, the is_greedy flags and the
    generated answers that differ."""
    worst, greedy_differs, loglikelihoods, answers_differ, answers = 0.0, 0, 0, [], 0
    for task, hf_samples in hf["samples"].items():
        by_doc = {s["doc_id"]: s for s in served["samples"][task]}
        for h in hf_samples:
            s = by_doc[h["doc_id"]]
            for h_resp, s_resp in zip(h["resps"], s["resps"]):
                h_out, s_out = h_resp[0], s_resp[0]
                if isinstance(h_out, (list, tuple)):  # (loglikelihood, is_greedy)
                    loglikelihoods += 1
                    worst = max(worst, abs(float(h_out[0]) - float(s_out[0])))
                    greedy_differs += bool(h_out[1]) != bool(s_out[1])
                else:
                    answers += 1
                    if h_out != s_out:
                        answers_differ.append({"doc": h["doc_id"], "hf": h_out,
                                               "server": s_out})
    return {"loglikelihood_requests": loglikelihoods, "max_abs_loglikelihood_diff": worst,
            "is_greedy_differs": greedy_differs, "generate_requests": answers,
            "answers_differ": answers_differ}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=None,
                    help="documents per task (default: all: 24 and 12)")
    ap.add_argument("--batch-size", type=int, default=8,
                    help="requests per batch (the server gets them as one prompt list)")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    try:
        import lm_eval
    except ImportError:
        print("lm_eval is not installed: pip install 'lm_eval[api,hf]' torch==<installed>",
              file=sys.stderr)
        return 2
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tasks = task_configs(DATA)
    with tempfile.TemporaryDirectory(prefix="lm-eval-check-") as tmp:
        served, served_s, exit_code = run_server(tasks, args.limit, args.batch_size, Path(tmp))
    hf, hf_s = run_hf(tasks, args.limit, args.batch_size)
    hf_scores, served_scores = scores(hf), scores(served)
    samples = compare_samples(hf, served)
    failures = [f"{task}: server {served_scores.get(task)} != HF {hf_scores[task]}"
                for task in hf_scores if served_scores.get(task) != hf_scores[task]]
    if samples["max_abs_loglikelihood_diff"] > LOGLIKELIHOOD_TOLERANCE:
        failures.append(f"a loglikelihood differs by {samples['max_abs_loglikelihood_diff']:.2e}"
                        f" (> {LOGLIKELIHOOD_TOLERANCE})")
    if exit_code != 0:
        failures.append(f"server exit code {exit_code} after SIGTERM")
    print(f"lm_eval {lm_eval.__version__}")
    for task in hf_scores:
        print(f"  {task:<20} server {served_scores.get(task)}  HF {hf_scores[task]}")
    print(f"  requests: {samples['loglikelihood_requests']} loglikelihood (largest difference "
          f"{samples['max_abs_loglikelihood_diff']:.2e}, is_greedy differs "
          f"{samples['is_greedy_differs']}), {samples['generate_requests']} generate "
          f"({len(samples['answers_differ'])} answers differ)")
    print(f"  seconds: server {served_s:.1f}, HF {hf_s:.1f}; failures: {failures or 'none'}")
    if args.json:
        from slotserve.lab.bench import write_report

        write_report(args.json, lm_eval_version=lm_eval.__version__, limit=args.limit,
                     batch_size=args.batch_size, engine_flags=ENGINE_FLAGS,
                     server_scores=served_scores, hf_scores=hf_scores, samples=samples,
                     seconds={"server": round(served_s, 1), "hf": round(hf_s, 1)},
                     server_exit_code=exit_code, failures=failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
