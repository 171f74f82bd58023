"""Real-kernel tests: see docs/realkernel.md and plugin.py.

Tests marked ``@pytest.mark.realkernel`` run inside a stock Debian kernel
booted once per session under QEMU; the host reports their guest outcome.
"""

from tests.realkernel.plugin import (  # noqa: F401  (hooks and fixtures, found by pytest by name)
    built_modules,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_terminal_summary,
    realkernel_kernel,
)
