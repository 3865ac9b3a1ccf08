"""`miles report RUN_DIR`: a self-contained HTML report of a run, finished or still running.

Torch-free; matplotlib (the `report` extra) is imported only when figures are drawn.
"""

from miles.core.report.build import PAGE, Written, build_report
from miles.core.report.figures import MissingDependencyError
from miles.core.report.load import NotARunError

__all__ = ["PAGE", "MissingDependencyError", "NotARunError", "Written", "build_report"]
