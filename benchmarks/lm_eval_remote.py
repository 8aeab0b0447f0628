"""lm-evaluation-harness scoring a running minfer server, unchanged: `local-completions` with
`tokenizer_backend=remote` (its `RemoteTokenizer` reads GET /tokenizer_info, then POST /tokenize and
/detokenize), so no Hugging Face tokenizer is downloaded, even for a GGUF-served model.

Two small tasks are written here (no dataset download): a loglikelihood task (continuations of short
sentences) and a multiple-choice task. Each loglikelihood lm-eval reports is then checked against the oracle,
the server's own echo logprobs (`/v1/completions` with `echo: true, max_tokens: 0, logprobs: 1`) of the same
token ids, split where lm-eval splits context and continuation.

    python -m minfer.serve --max-model-len 2048 &          # or any model
    pip install lm-eval==0.4.13                             # the `eval` extra
    python benchmarks/lm_eval_remote.py --url http://127.0.0.1:8000 --out assets/benchmarks/lm_eval_remote.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import httpx

LOGLIKELIHOOD = [  # (context, continuation)
    ("The capital of France is", " Paris"),
    ("One, two, three, four,", " five"),
    ("The sun rises in the", " east"),
    ("Water freezes at zero degrees", " Celsius"),
]
MULTIPLE_CHOICE = [  # (question, choices, index of the right one)
    ("The color of the sky on a clear day is", [" blue", " green", " red"], 0),
    ("Two plus two equals", [" seven", " four", " ten"], 1),
    ("The opposite of hot is", [" loud", " tall", " cold"], 2),
]

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{context}}}}"
{target}
metric_list:
  - metric: {metric}
"""


def write_tasks(root: Path) -> list[str]:
    """The two tasks as lm-eval YAML files over local JSON lines, under `root`; their names."""
    ll = root / "minfer_ll.jsonl"
    ll.write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in LOGLIKELIHOOD))
    mc = root / "minfer_mc.jsonl"
    mc.write_text("".join(json.dumps({"context": q, "choices": ch, "label": k}) + "\n"
                          for q, ch, k in MULTIPLE_CHOICE))
    (root / "minfer_ll.yaml").write_text(TASK_YAML.format(
        name="minfer_ll", data=ll, output_type="loglikelihood", metric="perplexity",
        target='doc_to_target: "{{continuation}}"'))
    (root / "minfer_mc.yaml").write_text(TASK_YAML.format(
        name="minfer_mc", data=mc, output_type="multiple_choice", metric="acc",
        target='doc_to_choice: "{{choices}}"\ndoc_to_target: label'))
    return ["minfer_ll", "minfer_mc"]


def echo_loglikelihood(url: str, model: str, context: str, continuation: str) -> float:
    """The oracle: the server's echo logprobs of context + continuation, summed over the continuation's
    tokens, split as lm-eval's `TemplateLM._encode_pair` splits them (the whole encoded, the context's tokens
    cut off)."""
    def tok(text):
        return httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                          timeout=60).json()["tokens"]

    n_spaces = len(context) - len(context.rstrip())  # lm-eval moves the context's trailing spaces over
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole, ctx = tok(context + continuation), tok(context)
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": whole, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0})
    r.raise_for_status()
    return sum(r.json()["choices"][0]["logprobs"]["token_logprobs"][len(ctx):])


def _pairs(sample) -> list[tuple[str, str]]:
    """The (context, continuation) pairs of one logged lm-eval sample."""
    args = sample["arguments"]
    items = args.values() if isinstance(args, dict) else args
    return [(a["arg_0"], a["arg_1"]) if isinstance(a, dict) else (a[0], a[1]) for a in items]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the running server")
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    model = httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    with tempfile.TemporaryDirectory() as tmp:
        tasks = write_tasks(Path(tmp))
        model_args = (f"model={model},base_url={args.url}/v1/completions,tokenizer_backend=remote,"
                      "num_concurrent=1,max_retries=1,tokenized_requests=True")
        results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks,
                                          task_manager=TaskManager(include_path=tmp), log_samples=True,
                                          limit=None)
    # The oracle scores the exact (context, continuation) pairs lm-eval sent (its `arguments`, target
    # delimiter included), so that a difference can only come from how it tokenized and read the answer
    checks, worst = [], 0.0
    for sample in results["samples"]["minfer_ll"]:
        (context, continuation), = [a[:2] for a in _pairs(sample)]
        got = sample["resps"][0][0][0]
        want = echo_loglikelihood(args.url, model, context, continuation)
        worst = max(worst, abs(got - want))
        checks.append({"context": context, "continuation": continuation, "lm_eval": got, "echo": want})
    mc_right = 0
    for sample in results["samples"]["minfer_mc"]:
        scores = [echo_loglikelihood(args.url, model, c, t) for c, t in _pairs(sample)]
        got = [r[0][0] for r in sample["resps"]]
        worst = max(worst, max(abs(a - b) for a, b in zip(got, scores)))
        mc_right += int(max(range(len(scores)), key=scores.__getitem__) == sample["doc"]["label"])
    acc = results["results"]["minfer_mc"]["acc,none"]
    out = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "lm_eval": lm_eval.__version__,
           "model": model, "model_args": model_args, "loglikelihood": checks,
           "multiple_choice_acc": acc, "multiple_choice_acc_from_echo": mc_right / len(MULTIPLE_CHOICE),
           "max_abs_diff_vs_echo": worst}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    ok = worst < 1e-4 and abs(acc - mc_right / len(MULTIPLE_CHOICE)) < 1e-9
    print("lm-eval's scores equal the echo logprobs" if ok else "MISMATCH", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
