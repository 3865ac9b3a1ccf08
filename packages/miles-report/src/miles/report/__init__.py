"""`miles report RUN_DIR`: a self-contained HTML report of a run, finished or still running.

Torch-free; matplotlib draws the figures (imported only when they are drawn).
"""

from miles.report.build import PAGE, Written, build_report
from miles.report.load import NotARunError

__all__ = ["PAGE", "NotARunError", "Written", "build_report"]
