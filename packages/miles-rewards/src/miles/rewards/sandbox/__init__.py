"""A sandbox for untrusted (model-written) Python: `run_python(code, stdin=..., limits=...)`.

What is enforced, how, and the fallbacks where the system does not allow it: docs/sandbox.md.
"""

from miles.rewards.sandbox.datatypes import SandboxLimits, SandboxResult, Status
from miles.rewards.sandbox.errors import SandboxError, SandboxUnavailable
from miles.rewards.sandbox.runner import Sandbox, run_python

__all__ = [
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "Status",
    "run_python",
]
