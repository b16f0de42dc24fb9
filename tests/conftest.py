"""Shared pytest setup. Each area keeps its fixtures in tests/fixtures/<area>.py."""

pytest_plugins = [
    "tests.fixtures.common",
    "tests.fixtures.slurm",
    "tests.fixtures.postgres",
    "tests.fixtures.sweeps",
    "tests.fixtures.whatif",
    "tests.fixtures.report",
    "tests.fixtures.hook",
    "tests.fixtures.guard",
]
