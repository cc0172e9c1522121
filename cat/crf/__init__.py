"""CTC-CRF: the CTC model trained with the CRF loss over a token-LM denominator graph."""
