"""Factories that build small test inputs (audio, data dirs, corpora) in a given directory."""
