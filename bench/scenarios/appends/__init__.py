"""Scenario E: messages appended per second through the trace service, next to what the database
allows, measured in the same run; its shapes, targets and checks: docs/benchmarks.md#e-trace-appends.
cases.py runs the cases, targets.py is what appends, measure.py reads CPU and counts the rows stored,
report.py writes E's section of latest.md."""
