"""Measuring a merge: the loss barrier along the path between aligned models or over the simplex of N
(barrier.py) and barrier.json, the report that the later stages read (report.py)."""
