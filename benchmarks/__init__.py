"""Benchmarks: the debugger's cost next to the plain run and the tools people use today.

Run all of them with ``make bench`` (or ``python -m benchmarks.run``); the test suite runs
them in a seconds-long ``--smoke`` mode that checks they work, never their timings.
"""
