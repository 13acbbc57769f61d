"""Weights that change while a model serves: updates in place (update.py), from the checkpoint's own names
through an overlay over the file the model was loaded from (overlay.py)."""
