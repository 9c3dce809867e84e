"""Drafters, one module per kind (`protocols.Drafter`): lm.py (a small LM), features.py (a feature
drafter), hidden.py (heads on the verifier's hidden state), ...; trees.py holds tree shapes,
gumbel.py the samplers that draw siblings, growth.py grows any tree one drafter call per level,
dyn.py is the dynamic tree method."""
