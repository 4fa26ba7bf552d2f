"""What is asked of a model: prompt templates, the chat body per model family, and a request's
effective settings (defaults, per-request overrides within the caps, re-ask sampling)."""
