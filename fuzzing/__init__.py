"""Coverage-guided fuzzers (atheris, libFuzzer) for what a peer can send and for the files a user
ingests: `python -m fuzzing frames|session|parsers --minutes N`. Install with
`pip install -e ".[fuzz]"` (atheris has wheels for CPython 3.11 on Linux)."""
