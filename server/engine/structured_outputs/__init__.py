"""Structured outputs: grammars compiled off the engine thread, token masks per step.

``limits`` checks a constraint's size before anything compiles it, ``compile_pool`` compiles
new ones in killable worker processes (``compile_worker``, which imports no torch), and
``backend`` holds the compiled grammars and fills each step's allowed-token bitmask.
Kept empty so that a compile worker importing its module loads nothing else.
"""
