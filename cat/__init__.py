"""CAT: recipes and a shared library for end-to-end Mandarin ASR on large corpora."""

from cat.core.threads import passive_waiting

# Before torch starts its OpenMP pool: threads sleep, not spin, while they wait
# (cat.core.threads says why).
passive_waiting()
