"""Where a guard plugs in: the one list (registry.py) and the guards' host sides.

A guard decides in core/<name>.py; what it needs from the node beyond the
observer and the shared executors is its host side here (side.py).
"""
