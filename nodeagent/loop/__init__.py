"""The loop: what runs the guards on the node (docs/design.md, "Shape").

wiring.py builds it, agent.py runs it, passes.py orders each pass and says when
the next one comes. Nothing here names a guard; nothing below imports this.
"""
