"""The error types shared across layers.

``NodeagentError`` is the one shown to operators: a single line naming what is
wrong. ``StepFailed`` is an action the node refused; it lives here, not beside
one executor, so every executor raises it without importing another.
"""


class NodeagentError(Exception):
    """Bad input or an unusable node: printed as one line, never a traceback."""


class StepFailed(Exception):
    """An action the node refused, with what the guard needs to know about it."""

    def __init__(
        self,
        error: str,
        err: int | None = None,
        messages: tuple[str, ...] = (),
        detail: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(error)
        self.error = error
        self.errno = err
        self.kernel_messages = messages
        self.detail = detail
