"""Held-out evaluation: the evaluator and its pass@k / maj@k estimators."""
