"""Defaults for the whole test session."""

import os

# Daemons the tests start serve no metrics unless a test asks for them with
# --metrics-address (on a free port): the default 127.0.0.1:9808 is one fixed
# port, so two test sessions on one machine would make each other's agents exit 2.
# The default itself is asserted on Config() in tests/test_metrics.py.
os.environ.setdefault("NODEAGENT_METRICS_ADDRESS", "off")

# Hypothesis times each example (200 ms) and the data generation ("too_slow"): both are
# timed assertions a busy machine crosses (docs/testing.md). Off for every test, not
# only those that remembered to say so; a hang is still caught by the waits' deadlines.
from hypothesis import HealthCheck, settings

settings.register_profile("nodeagent", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("nodeagent")
