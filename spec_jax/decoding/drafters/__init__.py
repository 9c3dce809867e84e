"""Drafters, one module per kind (`protocols.Drafter`): lm.py (a small LM: chains and trees),
hidden.py (heads on the verifier's hidden state); trees.py holds tree shapes and samplers."""
