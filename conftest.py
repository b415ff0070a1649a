"""Hooks for every pytest run of this repository, tests/ and notebooks/ alike (the tests' fixtures live in
tests/conftest.py): at the end of a run, the time each notebook took, slowest first, so a run that grows shows
where (the ten slowest tests come from pytest's own ``--durations=10``)."""

from collections import defaultdict


def pytest_terminal_summary(terminalreporter):
    seconds = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            path = getattr(report, "nodeid", "").split("::")[0]
            if path.endswith(".ipynb"):  # nbval: one item per cell; setup, call and teardown summed
                seconds[path] += getattr(report, "duration", 0.0) or 0.0
    if seconds:
        terminalreporter.write_sep("=", "time per notebook (its cells summed)")
        for path, total in sorted(seconds.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{total:8.1f} s  {path}")
