#!/usr/bin/env python3
"""Runs the workspace's test binaries a few at a time, as `cargo test` would
run them one after another.

Most of the suite's wall time is test binaries that wait: on servers they
start, on Envoy, NATS, timeouts. `cargo test` runs the binaries one by one,
so those waits add up; running `--jobs` binaries at once overlaps them.
Each binary still runs its own tests in parallel, exactly as under
`cargo test` (same arguments, working directory = its package, the same
CARGO_* variables), and its output is printed whole when it ends, so logs
never interleave. Binaries whose timing checks need the machine to
themselves (`--alone`, by target name) run after the others, one at a time.

Input: the JSON messages of
`cargo test --workspace --all-targets --no-run --message-format=json-render-diagnostics`.
Extra commands (`--also "cargo test --workspace --doc"`) run in the pool too.
Exit status: 0 when every binary and command passed. The last line counts
the tests of every binary and command: `tests: N passed, N failed, N ignored`.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

RESULT = re.compile(
    r"^test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored", re.MULTILINE
)


def binaries(messages_path):
    """(label, argv, cwd, env) of every test binary cargo built."""
    found = []
    seen = set()
    with open(messages_path, encoding="utf-8") as messages:
        for line in messages:
            line = line.strip()
            if not line.startswith("{"):
                continue
            message = json.loads(line)
            if message.get("reason") != "compiler-artifact":
                continue
            executable = message.get("executable")
            if not executable or not message.get("profile", {}).get("test"):
                continue
            if executable in seen:
                continue
            seen.add(executable)
            target = message["target"]
            manifest = message["manifest_path"]
            package = os.path.dirname(manifest)
            # `path+file:///…/dir#name@0.1.0`, or `…/name#0.1.0` when the
            # directory is named after the package.
            source, _, fragment = message["package_id"].partition("#")
            if "@" in fragment:
                package_name, _, version = fragment.partition("@")
            else:
                package_name, version = os.path.basename(source), fragment
            env = dict(os.environ)
            env.update(
                {
                    "CARGO_MANIFEST_DIR": package,
                    "CARGO_MANIFEST_PATH": manifest,
                    "CARGO_PKG_NAME": package_name,
                    "CARGO_PKG_VERSION": version,
                    "CARGO_CRATE_NAME": target["name"].replace("-", "_"),
                }
            )
            cargo = shutil.which("cargo")
            if cargo:
                env.setdefault("CARGO", cargo)
            label = f"{package_name} {'/'.join(target['kind'])} {target['name']}"
            found.append((label, target["name"], [executable], package, env))
    return found


def run(label, argv, cwd, env, shell=False):
    start = time.monotonic()
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as out:
        status = subprocess.run(
            argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, shell=shell
        ).returncode
        out.seek(0)
        text = out.read()
    return label, status, time.monotonic() - start, text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("messages", help="cargo's JSON messages of the test build")
    parser.add_argument("--jobs", type=int, default=3, help="binaries at once (default 3)")
    parser.add_argument(
        "--alone",
        action="append",
        default=[],
        help="test target name to run after the others, alone (repeatable)",
    )
    parser.add_argument(
        "--first",
        action="append",
        default=[],
        help="test target name to start before the others (repeatable; long ones first)",
    )
    parser.add_argument(
        "--also", action="append", default=[], help="a shell command to run in the pool"
    )
    args = parser.parse_args()

    found = binaries(args.messages)
    if not found:
        print("no test binaries in the build messages", file=sys.stderr)
        return 1
    pooled = [b for b in found if b[1] not in args.alone]
    pooled.sort(key=lambda b: args.first.index(b[1]) if b[1] in args.first else len(args.first))
    alone = [b for b in found if b[1] in args.alone]
    lock = threading.Lock()
    totals = [0, 0, 0]
    failures = []

    def report(result):
        label, status, seconds, text = result
        with lock:
            print(f"\n---- {label}: {'ok' if status == 0 else f'FAILED (exit {status})'} "
                  f"in {seconds:.1f}s", flush=True)
            sys.stdout.write(text)
            sys.stdout.flush()
            for passed, failed, ignored in RESULT.findall(text):
                totals[0] += int(passed)
                totals[1] += int(failed)
                totals[2] += int(ignored)
            if status != 0:
                failures.append(label)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        jobs = [pool.submit(run, command, command, None, dict(os.environ), True)
                for command in args.also]
        jobs += [pool.submit(run, label, argv, cwd, env) for label, _, argv, cwd, env in pooled]
        for job in jobs:
            report(job.result())
    for label, _, argv, cwd, env in alone:
        report(run(label, argv, cwd, env))

    if failures:
        print("\nfailed: " + ", ".join(failures))
    print(f"\ntests: {totals[0]} passed, {totals[1]} failed, {totals[2]} ignored")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
