"""Graphs: token n-gram acceptors and CTC-CRF denominator graphs (`denominator`)."""
