"""Benchmarks and accuracy evaluation that reproduce EPIC's comparisons (`epic-rag bench ...`)."""
