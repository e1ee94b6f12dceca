"""Helpers shared by the test modules and the benchmarks; no tests here."""
