"""The one error type shown to operators: a single line naming what is wrong."""


class NodeagentError(Exception):
    """Bad input or an unusable node: printed as one line, never a traceback."""
