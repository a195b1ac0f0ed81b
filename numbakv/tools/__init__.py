"""The `numbakv` command and its tools: cli, demo, bench, bench_seqops, precompile.

Nothing in the library imports this package (tests/test_layout.py checks it).
"""
