"""exit_after_gloo: the process ends with the given code, its buffered output written, and no
atexit handler runs (the interpreter's teardown is what aborts gloo processes)."""

import subprocess
import sys

PROG = """
import atexit, sys
from shoal.common.procexit import exit_after_gloo
atexit.register(lambda: print("teardown ran"))
sys.stdout.write("results written")
exit_after_gloo(3)
print("not reached")
"""


def test_exit_after_gloo_flushes_and_skips_teardown():
    p = subprocess.run([sys.executable, "-c", PROG], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3
    assert p.stdout == "results written"
