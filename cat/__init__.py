"""CAT: recipes and a shared library for end-to-end Mandarin ASR on large corpora."""
