"""Using a trained encoder: embedding inputs and corpora, serving them from MLflow, indexing and searching."""
