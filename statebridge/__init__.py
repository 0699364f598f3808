"""statebridge: move Mamba-family recurrent state between prefill and decode TP groups."""
