"""Which files of slimish/ one RL step of the quickstart executes, in every process of the job (driver, trainer and
rollout actors, engines' and reward workers' Python), and their lines: what README's "one RL step" section lists.

  .venv/bin/python tools/step_files.py [--steps 3] [--step 2] [key=value ...]

It runs the quickstart config (after `slimish make-tiny --out artifacts/tiny`) with no SFT warm-up, evaluation or
checkpoints, with a profiler in every Python process of the job (a sitecustomize on PYTHONPATH) that records, per
slimish file, the 10 ms slots in which a function of it was called (threads Python starts), or was on a thread's
stack in a sample taken every 0.5 ms (threads C++ starts: a Ray actor's concurrency groups, where the trainer's calls
run; a function that returns within half a millisecond there can be missed); `run.phase_hook` records when each step's
rollout begins. A file counts when it was called between step `--step`'s rollout and the next step's. The last line
is the count and the lines they hold.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "slimish"

SITECUSTOMIZE = '''
import json, os, sys, threading, time
_ROOT, _OUT = os.environ["STEP_FILES_ROOT"], os.environ["STEP_FILES_OUT"]
_slots = {}

def _profile(frame, event, arg):
    if event == "call":
        name = frame.f_code.co_filename
        if name.startswith(_ROOT):
            _slots.setdefault(name, set()).add(int(time.time() * 100))

def _sample():
    # Threads that C++ starts (a Ray actor's concurrency groups: the trainer's calls) never see threading.setprofile:
    # every 0.5 ms, the files on every thread's stack are recorded too.
    while True:
        time.sleep(0.0005)
        slot = int(time.time() * 100)
        for frame in list(sys._current_frames().values()):
            while frame is not None:
                name = frame.f_code.co_filename
                if name.startswith(_ROOT):
                    _slots.setdefault(name, set()).add(slot)
                frame = frame.f_back

def _dump():
    while True:  # actors are killed, not exited: write what was seen every second
        time.sleep(1.0)
        path = os.path.join(_OUT, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({name: sorted(slots) for name, slots in list(_slots.items())}, f)
        os.replace(path + ".tmp", path)

sys.setprofile(_profile)
threading.setprofile(_profile)
threading.Thread(target=_dump, daemon=True).start()
threading.Thread(target=_sample, daemon=True).start()
'''

HOOK = '''
import json, os, time

def phase(name, step, engine_urls):
    with open(os.path.join(os.environ["STEP_FILES_OUT"], "phases.jsonl"), "a") as f:
        f.write(json.dumps({"phase": name, "step": step, "t": int(time.time() * 100)}) + "\\n")
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--step", type=int, default=2, help="the step whose files are listed")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        site, out = Path(tmp) / "site", Path(tmp) / "out"
        site.mkdir()
        out.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (site / "step_files_hook.py").write_text(HOOK)
        env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}", "STEP_FILES_ROOT": str(PACKAGE) + os.sep,
               "STEP_FILES_OUT": str(out)}
        cmd = [sys.executable, "-m", "slimish.cli", "train", str(REPO / "configs/quickstart_cpu.yaml"),
               f"rl.num_steps={args.steps}", "sft.steps=0", "eval.every=0", "checkpoint.save_every=0",
               f"run.output_dir={tmp}/runs", "run.phase_hook=step_files_hook.phase", *args.overrides]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        phases = [json.loads(line) for line in (out / "phases.jsonl").read_text().splitlines()]
        starts = {p["step"]: p["t"] for p in phases if p["phase"] == "rollout"}
        begin, end = starts[args.step], starts[args.step + 1]
        files: set[str] = set()
        for dump in out.glob("*.json"):
            for name, slots in json.loads(dump.read_text()).items():
                if any(begin <= slot < end for slot in slots):
                    files.add(name)
    rows = sorted((str(Path(name).relative_to(REPO)), len(Path(name).read_text().splitlines())) for name in files)
    for name, lines in rows:
        sys.stdout.write(f"{lines:6d}  {name}\n")
    sys.stdout.write(f"step {args.step}: {len(rows)} files, {sum(lines for _, lines in rows)} lines\n")


if __name__ == "__main__":
    main()
