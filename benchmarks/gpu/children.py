"""Each case of a GPU benchmark in a fresh child Python: torch's caching allocator untouched by
the cases before it, and a crash or an out-of-memory confined to its case."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env() -> dict[str, str]:
    """This environment, with the repository's python/ first on PYTHONPATH (vramkit built in place)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(REPO, "python"),
                                                                     os.environ.get("PYTHONPATH")])))


def run_children(script: str, cases: list[str], args: list[str], timeout: float) -> list[dict]:
    """``script --case CASE *args`` for each case, each printing its result as one JSON object
    on its last stdout line; a case whose child fails is ``{"case", "error"}`` (its stderr's
    tail). Each result is echoed on stderr as it comes."""
    env = child_env()
    results: list[dict] = []
    for case in cases:
        r = subprocess.run([sys.executable, script, "--case", case, *args], capture_output=True, text=True, env=env,
                           timeout=timeout)
        if r.returncode != 0:
            results.append({"case": case, "error": r.stderr[-3000:]})
            print(f"{case}: FAILED\n{r.stderr[-3000:]}", file=sys.stderr, flush=True)
            continue
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results
