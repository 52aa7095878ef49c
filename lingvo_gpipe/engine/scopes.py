"""Name scopes the engine builds and `trace.py` reads; no TensorFlow here.

`trace.py` parses traced steps in processes that need not load TensorFlow
(`tools/plan.py partition`), so the names both sides share live here.
"""

# The name scope of a forward body built inline (`stage.Stage.InlineForward`).
INLINE_FORWARD_SCOPE = 'inline_forward'
