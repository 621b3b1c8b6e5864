"""Deployment: quantised variants and their parity (quantize), the MLflow pyfunc that solves tasks with the tools
(pyfunc), the promotion gate (gate: pure functions) and its registry operations (registry), and HTTP serving (serve).

Imports nothing heavy at package import; the phase entry point is ``pipeline.deploy.main``.
"""
