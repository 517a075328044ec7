"""Python source shared by the hidden-test graders (built-in tasks, HumanEval, repository tasks).

The graders are scripts that run inside scoring sandboxes, so what they share is source text, concatenated
into each script. Invariants: each snippet is self-contained (it imports what it uses) and defines only the
names listed in its docstring.
"""

LITERAL_DECODER = """import ast
class _Finite(ast.NodeTransformer):
    def visit_Name(self, node):
        if node.id in ("inf", "nan"):
            return ast.copy_location(ast.Constant(float(node.id)), node)
        raise ValueError("not a literal: " + node.id)
def decode(text):
    return ast.literal_eval(_Finite().visit(ast.parse(text.strip(), mode="eval")))
"""
"""Defines ``decode(text)``: ``ast.literal_eval`` that also accepts ``inf`` and ``nan`` (the repr of
non-finite floats)."""

CHILD_END = """import os, subprocess, sys
def reap(child, ended):
    died = None
    if ended:  # the solution process closed our channel: learn how it ended
        try:
            died = child.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    child.kill()
    child.wait()
    return died
def reraise(died):
    sys.stdout.flush()
    if died is not None and died < 0:
        os.kill(os.getpid(), -died)  # the sandbox sees the signal that ended the solution (CPU, file size)
"""
"""Defines ``reap(child, ended)`` (the signal that ended the solution's process, if it ended by itself; the
process is killed and reaped either way) and ``reraise(died)`` (flush the verdict, then die of that same
signal, so the sandbox reports the limit the solution hit)."""
