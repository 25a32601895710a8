"""Validation against reality: real multi-process training on this machine (``measure``), the
prediction next to the measurement (``compare``), and published cluster measurements
(``published``)."""

from echo.validate.compare import run_compare
from echo.validate.measure import check_measurable, run_measure

__all__ = ["check_measurable", "run_compare", "run_measure"]
