"""The capstone's harness moved to :mod:`kernel_lib.bench.capstone`, beside the other measuring code; this name
stays importable for code written against it, and is that same module."""

import sys

from ..bench import capstone as _capstone

sys.modules[__name__] = _capstone
