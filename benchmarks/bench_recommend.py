"""Wall time of `optplan recommend` end to end (child-process profile + search) on the examples.

Run: python benchmarks/bench_recommend.py   (prints one row per case; no assertions — figures only). The profile
cache is off (``OPTPLAN_PROFILE_CACHE=off``): each row pays for a real profile, as a first run does.
Target (issue 2): examples/gpt2.py under 30 s on a 2-core CPU machine; 70B Llama profile under 60 s.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("gpt2", "examples/gpt2.py", {}, []),
    ("mlp", "examples/mlp.py", {}, []),
    ("resnet50", "examples/resnet.py", {}, []),
    ("llama-1B", "examples/llama.py", {"OPTPLAN_LLAMA_SIZE": "1B"}, []),
    ("llama-8B", "examples/llama.py", {"OPTPLAN_LLAMA_SIZE": "8B"}, []),
    ("llama-70B", "examples/llama.py", {"OPTPLAN_LLAMA_SIZE": "70B"}, ["--gpus", "8", "--gpu", "H100-SXM"]),
]


def main() -> None:
    exe = shutil.which("optplan") or str(Path(sys.executable).with_name("optplan"))
    print(f"{'case':<10} {'wall s':>7} {'child maxRSS GiB':>17} {'fits':>5}  plan / verdict")
    for name, path, env, extra in CASES:
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t0 = time.perf_counter()
        run = subprocess.run([exe, "recommend", str(ROOT / path), "--json", *extra], capture_output=True,
                             text=True, env={**os.environ, **env, "OPTPLAN_PROFILE_CACHE": "off"})
        wall = time.perf_counter() - t0
        rss = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2**20
        try:
            doc = json.loads(run.stdout)
            verdict = (f"{doc['plan']['precision']} ZeRO-{doc['plan']['zero']} mbs {doc['plan']['mbs']}"
                       if doc["fits"] else doc["suggestions"][0][:70])
            fits = str(doc["fits"])
        except (json.JSONDecodeError, KeyError, IndexError):
            verdict, fits = (run.stderr.strip().splitlines() or ["?"])[-1][:70], "err"
        print(f"{name:<10} {wall:>7.1f} {rss:>17.2f} {fits:>5}  {verdict}")


if __name__ == "__main__":
    main()
