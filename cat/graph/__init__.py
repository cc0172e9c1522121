"""Graphs: token n-gram acceptors and CTC-CRF denominator graphs (`denominator`), the
command that builds an experiment's (`den_graph`), TLG decoding graphs (`tlg`)."""
