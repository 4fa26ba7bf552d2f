"""How a model's reply becomes a score or a label — pure rules, no I/O: the answer a template
declares, its scale, the estimate over samples or token probabilities, preference labels, the
structured-output regex, and the reply type they read."""
