"""Run D: episodes → embeddings → SRPO progress per task; the pure math, the
embedding call and the persistent reference store."""
