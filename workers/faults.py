"""Fault injection for the failure tests, off unless `RLT_FAULT_INJECT` names a fault.

Some failures cannot be produced from outside without races: a write that never posts (the
receiver must time out instead of waiting forever), a request that sits received but not yet
activated, and a request that is still running when its worker dies. Each fault here does exactly
one such thing, in the role that would do it in a real failure, and is read once at start-up;
with the variable unset every check is a dict lookup.

    RLT_FAULT_INJECT="skip_state_write=N"    prefill: for prompts of exactly N tokens, never post the
                                              final-state write (but count it), like a lost write
    RLT_FAULT_INJECT="hold_activate=SECONDS" decode: process an Activate only SECONDS after it came
    RLT_FAULT_INJECT="hold_prefill=N,hold_prefill_s=SECONDS"
                                              prefill: for prompts of exactly N tokens, start a Prefill
                                              only SECONDS after it came, even if its Abort came first
                                              (a stalled writer the router lost track of)
    RLT_FAULT_INJECT="step_delay=SECONDS"     any role: sleep SECONDS after each engine step that made
                                              output (a slow model: a long request is surely still
                                              running when a test kills its worker)
"""

from __future__ import annotations

import os

FAULTS: dict[str, float] = {}
for _item in filter(None, os.environ.get("RLT_FAULT_INJECT", "").split(",")):
    _name, _, _value = _item.partition("=")
    FAULTS[_name.strip()] = float(_value) if _value else 1.0


def fault(name: str) -> float | None:
    """The injected fault's value, or None when it is not injected."""
    return FAULTS.get(name)
