"""Pure decision code: guards over a node snapshot. Never imports nodeagent.host."""
