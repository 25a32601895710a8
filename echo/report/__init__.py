"""report: compare, validate and audit results (``echo.report.audit(sql, results_dir)``)."""

from echo.report.audit import audit, connect, summaries, summaries_table

__all__ = ["audit", "connect", "summaries", "summaries_table"]
