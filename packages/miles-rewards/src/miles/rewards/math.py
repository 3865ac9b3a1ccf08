"""`math`: 1.0 when the response's final answer is mathematically equal to the reference, checked
with Hugging Face's math-verify (LaTeX/expression extraction, then sympy equivalence: so
`\\boxed{\\frac{1}{2}}` matches a reference of `0.5`, and `(1,2)` an open interval).

Verification is CPU-bound and can take seconds on adversarial output, so by default it runs in a
small pool of worker processes: the rollout event loop keeps streaming while sympy works, and
math-verify's signal-based time-outs are enforced (they only work on a process's main thread).
The workers are spawned (not forked), so, as with any spawn pool, a script that scores with this
reward at top level must guard its entry point with `if __name__ == "__main__":`.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from miles.core.contracts.types import Sample
from miles.rewards.configs import MathConfig


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed: the response was cut off inside the box


def verify_answer(reference: str, response: str, boxed_only: bool, timeout_s: int | None) -> float:
    """1.0 if `response`'s answer equals `reference` per math-verify, else 0.0. Raises ValueError
    when the reference itself does not parse (a data problem, not a wrong response)."""
    from math_verify import parse, verify  # heavy (sympy, antlr): imported where it runs

    # A bare reference ("0.5", "\frac{1}{2}", "\sqrt{2}") is read as if boxed: math-verify's LaTeX
    # extraction needs a delimiter, and \boxed{} is the most forgiving one.
    delimited = "$" in reference or "\\boxed" in reference
    gold = parse(reference if delimited else f"\\boxed{{{reference}}}", parsing_timeout=timeout_s)
    if not gold:
        gold = parse(reference, parsing_timeout=timeout_s)
    if not gold:
        raise ValueError(f"math: math-verify cannot parse the reference answer {reference!r}")
    if boxed_only:
        boxed = last_boxed(response)
        if boxed is None:
            return 0.0
        response = f"\\boxed{{{boxed}}}"
    pred = parse(response, parsing_timeout=timeout_s)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout_s) else 0.0


def _verify_here(reference: str, response: str, boxed_only: bool, timeout_s: int) -> float:
    # signal.alarm exists only on the main thread; elsewhere math-verify raises, so go without.
    on_main = threading.current_thread() is threading.main_thread()
    return verify_answer(reference, response, boxed_only, timeout_s if on_main else None)


class MathVerify:
    reward_range: tuple[float, float] = (0.0, 1.0)
    deterministic: bool = True

    def __init__(self, config: MathConfig) -> None:
        self.config = config
        self._pool: ProcessPoolExecutor | None = None

    async def __call__(self, response: str, sample: Sample) -> float:
        key = self.config.answer_key
        if key not in sample.metadata:
            raise KeyError(
                f"math: the data row has no {key!r} field (fields: {sorted(sample.metadata)}); "
                "set reward.answer_key"
            )
        args = (str(sample.metadata[key]), response, self.config.boxed_only)
        if self.config.workers == 0:
            return _verify_here(*args, self.config.verify_timeout_s)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._executor(), _verify_here, *args, self.config.verify_timeout_s
            )
        except BrokenProcessPool:
            self._pool = None  # a worker died (OOM, signal): start afresh on the next call
            raise

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the caller may hold threads (Ray, torch) that fork would corrupt.
            self._pool = ProcessPoolExecutor(
                self.config.workers, mp_context=multiprocessing.get_context("spawn")
            )
        return self._pool

    def __getstate__(self) -> dict[str, object]:
        # Ray pickles rewards into actors: ship the config, the copy starts its own workers.
        return {**self.__dict__, "_pool": None}

    def close(self) -> None:
        """Stops the worker processes (they also stop with the interpreter)."""
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
