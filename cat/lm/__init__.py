"""Language models: n-gram estimation (ARPA), kenlm-backed scorers for fusion and rescoring."""
