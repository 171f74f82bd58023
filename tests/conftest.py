"""Defaults for the whole test session."""

import os

# Daemons the tests start serve no metrics unless a test asks for them with
# --metrics-address (on a free port): the default 127.0.0.1:9808 is one fixed
# port, so two test sessions on one machine would make each other's agents exit 2.
# The default itself is asserted on Config() in tests/test_metrics.py.
os.environ.setdefault("NODEAGENT_METRICS_ADDRESS", "off")
