"""`python -m fuzzing frames|session|parsers [--minutes N] [--corpus DIR]`: run one fuzzer for N
minutes (libFuzzer prints the inputs tried; a crash is saved as crash-<sha1> and fails the
run). The corpus directory keeps what the fuzzer learned between runs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import atheris
import platformdirs

FUZZING_CHILD = "TANDEM_FUZZING_CHILD"


def in_a_child() -> int:
    """Run this command again in a child of this (small) process; its exit status.

    libFuzzer's memory limit (-rss_limit_mb, 2 GB unless set) reads the process's peak RSS
    from getrusage, and Linux carries that peak over an exec from the process that started
    it: launched from a large one (a test run holding models: 4.9 GB in CI), the fuzzer
    stopped "out of memory" at once, whatever the inputs. A process this one forks starts
    from this one's peak, a few MB. `-P` with the repository root on PYTHONPATH: the child
    imports this checkout, never what the working folder holds."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, FUZZING_CHILD: "1", "PYTHONPATH": path}
    return subprocess.call([sys.executable, "-P", "-m", "fuzzing", *sys.argv[1:]], env=env)


def main() -> None:
    if FUZZING_CHILD not in os.environ:
        sys.exit(in_a_child())
    parser = argparse.ArgumentParser(prog="python -m fuzzing", description=__doc__)
    parser.add_argument("target", choices=["frames", "session", "parsers"])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--corpus", type=Path, help="default: a fresh directory of seeds")
    args, libfuzzer = parser.parse_known_args()
    cache = Path(platformdirs.user_cache_dir("tandem")) / "fuzzing"
    corpus = args.corpus or Path(tempfile.mkdtemp(prefix=f"tandem-fuzz-{args.target}-"))
    corpus.mkdir(parents=True, exist_ok=True)
    timeout: list[str] = []
    if args.target == "frames":
        from fuzzing import frames

        seeds, test_one = frames.seeds(), frames.test_one
    elif args.target == "parsers":
        with atheris.instrument_imports(
            include=["personal_index", "retrieval", "pypdf", "docx", "bs4", "html"]
        ):
            from fuzzing import parsers

        seeds, test_one = parsers.seeds(), parsers.test_one
        timeout = ["-timeout=20", "-rss_limit_mb=4096"]  # a hang or a blow-up is a finding
    else:
        from fuzzing import session

        harness = session.Harness(cache)
        seeds, test_one = session.seeds(), harness.test_one
    for i, seed in enumerate(seeds):
        (corpus / f"seed-{i:02d}").write_bytes(seed)
    seconds = max(1, round(args.minutes * 60))
    argv = [sys.argv[0], f"-max_total_time={seconds}", "-print_final_stats=1", *timeout, *libfuzzer]
    atheris.Setup([*argv, str(corpus)], test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
