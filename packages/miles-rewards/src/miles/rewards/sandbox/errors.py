"""The sandbox's own failures, and the message that says why strong isolation was refused."""

from __future__ import annotations

from typing import Any


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program in it): an internal error."""


class SandboxUnavailable(SandboxError):
    """Strong isolation is not available here, and `allow_weak` is off: nothing was run."""


# The isolation steps that strong isolation needs (`_launcher.REQUIRED`), in words.
STEPS = {
    "netns": "a network namespace",
    "pidns": "a pid namespace",
    "mountns": "a mount namespace",
    "ipcns": "an IPC namespace",
    "private_root": "a private root file system (pivot_root)",
    "private_proc": "a /proc of its own",
    "uid": "a uid of its own (root is needed to switch to it)",
    "seccomp": "a seccomp filter (no namespaces, keyrings or mounts of its own)",
}


def refusal(missing: list[str], setup: dict[str, Any]) -> str:
    """Why the launcher refused to run the program: the `missing` steps, each with its error."""
    why = []
    for name in missing:
        error = (
            setup.get(f"{name}_error")
            or setup.get("reason")
            or "not attempted, as a step it needs failed"
        )
        why.append(f"{STEPS.get(name, name)} ({error})")
    return (
        "the sandbox refuses to run untrusted code with weak isolation: it could not set up "
        + "; ".join(why)
        + ". Run as root where namespaces are allowed, or set `sandbox.allow_weak: true` in the "
        "code reward's config (`Sandbox(allow_weak=True)`) to run it anyway, with the weaker "
        "isolation that docs/sandbox.md describes."
    )
