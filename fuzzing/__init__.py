"""Coverage-guided fuzzers (atheris, libFuzzer) for what a peer can send: `python -m fuzzing
frames|session --minutes N`. Install with `pip install -e ".[fuzz]"` (atheris has wheels for
CPython 3.11 on Linux)."""
